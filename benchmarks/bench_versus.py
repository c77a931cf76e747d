"""Issue 21's head to head: plain mlx-lm, mlx-lm's speculative decoding with a draft model, and ours.

One run, one machine, one packed target (the same model object for every method), greedy. For every
prompt of each held-out set (HumanEval, MT-Bench first turns, GSM8K test; ``mlx_dflash2/data/evalsets``)
it runs:

- ``plain``: ``mlx_lm.generate.generate_step`` on the target (the reference every output is compared with);
- ``mlx-spec``: ``mlx_lm.generate.speculative_generate_step`` with the draft model (default
  Qwen2.5-Coder-0.5B-Instruct, packed from its GGUF like the target) at each ``--num-draft`` (2, 4, 6);
  per set its best ``num_draft_tokens`` (highest median speedup) is reported;
- ``auto``: ours, ``mlx_dflash2``'s default drafter (``--drafter auto``: the trained drafter shipped for
  the target under the adaptive schedule, or lookup drafting where none ships, which is the case for
  Qwen2.5-Coder-1.5B until issue 21's drafter is trained);
- ``lookup``: ours with ``--drafter lookup`` (suffix matches of the request's own history, B = 8);
- ``ours-plain`` (only when asked for): our loop without a proposer (``--drafter none``), the cost of our own plain
  steps against ``mlx_lm``'s (what the adaptive schedule's plain rounds run);
- ``adaptive`` (only when asked for, with ``--drafter DIR`` or ``shipped``): ours with that drafter under the
  adaptive schedule (``--adaptive``: the schedule a shipped drafter gets by default), where ``auto`` runs a
  drafter directory as the CLI's ``--drafter DIR`` does, fused with lookup in every round.

Where ``auto`` resolves to the same lookup proposer as ``lookup`` it is measured once and reported for
both (the JSON says so). Each prompt's K/V is prefilled once (all but the last prompt token, by our loop)
and handed to every method, the draft model's own K/V too, so the timed part of a request is its decode:
**tok/s = generated tokens / seconds from the request's start to its last token** (the last prompt token's
forward included, the EOS counted when it ends the answer). Reported per set and method: median tok/s
over the prompts, median speedup over plain (per prompt), tau (generated tokens per target forward,
pooled over the set's prompts) and output identity with plain (prompts identical / prompts). The target's
verify cost ``T(M)/T(1)`` on this machine is measured first (:func:`mlx_dflash2.calibrate.measure_verify_costs`).
The methods' order turns from prompt to prompt (``--order rotate``, the default since session 39: a set's ``i``-th
prompt, counting those ``--skip`` leaves out, starts at the ``i``-th method), so within each set no method is always the
one timed first after a prefill, and a run split by ``--skip`` goes on turning where the last part stopped; ``--order
fixed`` runs plain first every time, as every run before session 39 did.
A progress line goes to stderr for every request; the JSON is rewritten after each, and a plot of
speedup and tau per set is drawn at the end.

    python -m mlx_dflash2.assets fetch qwen2.5-coder-1.5b-instruct
    python -m mlx_dflash2.assets fetch qwen2.5-coder-0.5b-instruct
    scripts/run python benchmarks/bench_versus.py                        # 20 prompts per set, 256 tokens
    scripts/run python benchmarks/bench_versus.py --prompts 3 --max-tokens 64 --out benchmarks/results/versus-cpu.json
    scripts/run python benchmarks/bench_versus.py --replot benchmarks/results/versus-cpu.json
    scripts/run python benchmarks/bench_versus.py --drafter .cache/train/c6-q4 ...   # a drafter not shipped
    # one comparison split over device calls (each call's time limit), then joined:
    ... bench_versus.py --prompts 10 --out a.json; ... bench_versus.py --prompts 10 --skip 10 --out b.json
    scripts/run python benchmarks/bench_versus.py --merge a.json b.json --out benchmarks/results/versus-gpu.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

sys.path[:0] = [str(Path(__file__).resolve().parents[1])]  # this checkout (the docstring's commands run from it)
import mlx_dflash2  # noqa: F401,E402  (before MLX: loads the optimized OpenBLAS, mlx_dflash2/_blas.py)
import mlx.core as mx

from mlx_dflash2 import assets
from mlx_dflash2.drafter.io import read_draft_vocab, read_drafter_checkpoint
from mlx_dflash2.loading import FLOAT_DTYPES, ModelNotFoundError, drafter_dequantize, load_target, make_proposer
from mlx_dflash2.proposers import LookupProposer
from mlx_dflash2.speculative import GenerationState, SpecStats, speculative_generate_step
from mlx_dflash2.train.data import EVAL_SETS, load_eval_set

METHODS = ("plain", "mlx-spec", "auto", "lookup", "adaptive", "ours-plain")
DEFAULT_METHODS = ("plain", "mlx-spec", "auto", "lookup")
LABELS = {"plain": "plain mlx_lm", "mlx-spec": "mlx-lm speculative", "auto": "ours (auto)", "lookup": "ours (lookup)",
          "adaptive": "ours (adaptive schedule)", "ours-plain": "ours, no drafter (plain steps)"}


def _csv(kind, choices=None):
    def parse(text: str):
        try:
            out = [kind(x.strip()) for x in text.split(",") if x.strip()]
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected comma-separated {kind.__name__} values, got {text!r}") from None
        bad = [x for x in out if choices is not None and x not in choices]
        if bad or not out:
            raise argparse.ArgumentTypeError(f"choose from {', '.join(map(str, choices))}; got {text!r}")
        return out

    return parse


def _positive(text: str) -> int:
    try:
        v = int(text)
    except ValueError:
        v = 0
    if v < 1:
        raise argparse.ArgumentTypeError(f"expected an integer >= 1, got {text!r}")
    return v


def _model_path(arg: str | None, name: str, flag: str) -> str:
    """``arg``, else the fetched model ``name`` in the user's cache; exits with the fetch command if absent."""
    if arg:
        return arg
    path = assets.cached_model(name)
    if path is None:
        sys.exit(f"{flag}: {name} is not fetched; run `python -m mlx_dflash2.assets fetch {name}` (or pass {flag} PATH)")
    return str(path)


def _trim_to(cache: list, n: int) -> None:
    """Cut every layer of an mlx-lm KV cache back to its first ``n`` positions."""
    from mlx_lm.models.cache import trim_prompt_cache

    extra = cache[0].offset - n
    if extra > 0:
        trim_prompt_cache(cache, extra)


def _timed(gen, eos: set[int], max_tokens: int):
    """Drain a ``(token, logprobs, from_draft)`` generator until ``max_tokens`` or an EOS (counted).

    Returns ``(tokens, seconds from the call to the last token, from_draft flags)``."""
    toks, drafted = [], []
    tic = time.perf_counter()
    try:
        for t, _, d in gen:
            toks.append(int(t))
            drafted.append(bool(d))
            if toks[-1] in eos or len(toks) >= max_tokens:
                break
    finally:
        gen.close()
    return toks, time.perf_counter() - tic, drafted


def run_mlx(target, draft, ids, tcache, dcache, k, max_tokens, eos):
    """One request through mlx-lm (``k`` = 0: plain ``generate_step``; else speculative with ``k`` drafts).
    ``tcache``/``dcache`` hold ``ids[:-1]`` and are cut back to it afterwards. Returns tokens, seconds, rounds."""
    from mlx_lm.generate import generate_step, speculative_generate_step as mlx_spec

    y = mx.array(ids[-1:], dtype=mx.uint32)
    base = len(ids) - 1
    if k == 0:
        gen = ((t, lp, False) for t, lp in generate_step(y, target.model, max_tokens=max_tokens, prompt_cache=tcache))
    else:
        gen = mlx_spec(y, target.model, draft.model, num_draft_tokens=k, max_tokens=max_tokens,
                       prompt_cache=tcache + dcache)
    toks, secs, drafted = _timed(gen, eos, max_tokens)
    _trim_to(tcache, base)
    if dcache:
        _trim_to(dcache, base)
    # a round (target forward) yields its accepted drafts then one token of the target; a cut round counts too
    rounds = drafted.count(False) + (1 if drafted and drafted[-1] else 0)
    return toks, secs, rounds


def run_ours(target, proposer, ids, state, max_tokens, eos):
    """One request through our loop, reusing ``state`` (holds the prompt) as its prompt cache on a clone.
    Returns tokens, seconds, rounds, stats. ``rounds`` counts target forwards as :func:`run_mlx` does: the first
    token's forward (over the prompt's last token, which our statistics count with the prefill) is one; until
    session 36 it was left out, so ours' tau was over by up to one token per prompt (e.g. 256 / 68 for 256 / 69)."""
    stats = SpecStats()
    st = state.clone()
    gen = speculative_generate_step(ids, target, proposer, max_tokens=max_tokens, stats=stats, state=st)
    toks, secs, _ = _timed(gen, eos, max_tokens)
    assert st.reused == len(ids) - 1, (st.reused, len(ids))  # the timed request never re-prefills
    return toks, secs, stats.rounds + (1 if toks else 0), stats


def method_order(todo: list, j: int) -> list:
    """The methods of a prompt of turn ``j`` (:func:`prompt_jobs`) in the order they run under ``--order rotate``:
    ``todo`` rotated left by ``j``, so over ``len(todo)`` prompts of a set each method runs once in each position (a
    method always timed first after the prefill, or always after the others, would carry whatever that position costs
    or saves)."""
    n = len(todo)
    return todo[j % n:] + todo[:j % n] if n else []


def prompt_jobs(per_set: dict[str, list], prompts: int, skip: int) -> list[tuple[str, dict, int]]:
    """The run's requests, round-robin over the sets (so that a run cut short covers each), each as ``(set, prompt,
    turn)``: ``turn`` is the prompt's index in its set counting the ``skip`` left out, the :func:`method_order` it
    runs in. (Turned by the request's index in the run instead, as in session 39's first version, a set whose count
    shares a factor with the methods' saw only some of the turns: two sets and two methods ran plain first on every
    prompt of one set and last on every prompt of the other.)"""
    return [(s, ps[i], skip + i) for i in range(prompts) for s, ps in per_set.items() if i < len(ps)]


def method_label(meta: dict, row: dict) -> str:
    """A row's method as the log names it: its label, with mlx-lm's ``k`` where it has one."""
    return labels(meta)[row["method"]] + (f" k={row['k']}" if row.get("k") else "")


def summarize(rows: list[dict], sets: list[str], methods: list[str], num_draft: list[int]) -> list[dict]:
    """Per set and method: median tok/s, median speedup over plain, pooled tau, identical prompts.
    mlx-spec: the ``num_draft_tokens`` with the best median speedup (all of them are in ``by_k``)."""
    out = []
    for s in sets:
        rs = [r for r in rows if r["set"] == s]
        plain = {r["prompt"]: r for r in rs if r["method"] == "plain"}
        if not plain:
            continue

        def agg(sel):
            ok = [r for r in sel if r["prompt"] in plain]
            if not ok:
                return None
            return {
                "prompts": len(ok),
                "tps": statistics.median(r["tps"] for r in ok),
                "speedup": statistics.median(r["tps"] / plain[r["prompt"]]["tps"] for r in ok),
                "tau": sum(r["tokens"] for r in ok) / max(1, sum(r["rounds"] for r in ok)),
                "identical": sum(r.get("identical", r["tokens_out"] == plain[r["prompt"]]["tokens_out"])
                                 for r in ok),
            }

        for m in methods:
            if m == "mlx-spec":
                by_k = {k: agg([r for r in rs if r["method"] == m and r["k"] == k]) for k in num_draft}
                by_k = {k: v for k, v in by_k.items() if v}
                if not by_k:
                    continue
                best = max(by_k, key=lambda k: by_k[k]["speedup"])
                out.append({"set": s, "method": m, "k": best, **by_k[best],
                            "by_k": {str(k): v for k, v in by_k.items()}})
            else:
                a = agg([r for r in rs if r["method"] == m])
                if a:
                    out.append({"set": s, "method": m, "k": None, **a})
    return out


def ours_proposer(drafter: str, target, tokenizer, name: str, dequantize: bool, adaptive: bool | None = None,
                  trees: bool = True):
    """Our proposer for the ``auto`` method as ``mlx_dflash2.load`` builds it: ``drafter`` (``"auto"`` or a drafter
    directory) fused with lookup under its schedule, a quantized drafter expanded to dense where the target is
    (:func:`mlx_dflash2.loading.drafter_dequantize`: on MLX's CPU backend a quantized matmul costs time linear in
    its rows, and the drafter runs 16 of them; until session 34 this bench kept the drafter packed beside a dense
    target, ~2x the CLI's round time on this CPU). ``adaptive``: as ``load``'s (``None``: the adaptive schedule
    for ``"auto"`` only; ``True``: for a drafter directory too, as ``--adaptive``). ``trees``: as ``load``'s
    (``--no-trees``: chains only)."""
    return make_proposer(drafter, target, tokenizer, name, dequantize=drafter_dequantize(dequantize, target),
                         adaptive=adaptive, trees=trees)


# how rows count "rounds" (meta["rounds"]); a run saved without it and without meta["skip"] (before session 36's
# --skip, added minutes before the fix) left the first token's forward out of ours' rounds (run_ours); mlx-lm's
# counted it
ROUNDS = "target forwards, the first token's included"
MLX_METHODS = ("plain", "mlx-spec")


def count_first_forward(run: dict) -> tuple[dict, bool]:
    """``run`` with ours' rounds counted as :data:`ROUNDS` says: a run saved before gets one more round in each of
    ours' rows that generated a token (exactly what :func:`run_ours` now adds), its ``tau`` recomputed. Returns
    the run (a copy where changed) and whether it changed."""
    if run["meta"].get("rounds") == ROUNDS or "skip" in run["meta"]:
        return run, False
    rows = []
    for r in run["rows"]:
        if r["method"] not in MLX_METHODS and r["tokens"]:
            r = {**r, "rounds": r["rounds"] + 1}
            r["tau"] = r["tokens"] / r["rounds"]
        rows.append(r)
    return {**run, "meta": {**run["meta"], "rounds": ROUNDS}, "rows": rows}, True


# what runs joined by --merge must share (the rest, e.g. date, wall time, verify costs, stops, is per run)
MERGE_KEYS = ("target", "draft", "dtype", "dequantize", "draft_dequantize", "device", "mlx", "max_tokens",
              "repeats", "drafter")


def run_order(run: dict) -> str:
    """A saved run's ``--order`` (a run saved before session 39's ``--order`` ran the fixed one)."""
    return run["meta"].get("order", "fixed")


def identity_first_run_only(run: dict) -> bool:
    """Whether a saved run's ``identical`` compared only each method's first run: a ``--repeats`` > 1 run saved before
    session 40 (no row has ``repeats_agree``); a run since then compares every run (its rows say ``repeats_agree``).
    The other runs' tokens were not saved, so such a run cannot be brought to the new count."""
    return (run["meta"].get("repeats") or 1) > 1 and bool(run["rows"]) \
        and not any("repeats_agree" in x for x in run["rows"])


def merge_runs(runs: list[dict]) -> dict:
    """Saved runs of one comparison (same models, device, settings, methods, ``num_draft`` and ``--order``; otherwise
    ValueError: a method's median would be over other prompts than plain's, or over requests timed in two orders under
    one ``meta.order``) as one: their rows (a prompt measured by more than one run: ValueError), the union of their
    sets, and the summary recomputed.
    ``meta`` is the first run's, with ``merged`` listing each run's date and rows. A run saved before ours' rounds
    counted the first token's forward gets it (:func:`count_first_forward`; ``merged`` says which): a tau over
    runs of both counts would mix them. A ``--repeats`` run whose identity compared only its first runs
    (:func:`identity_first_run_only`) is marked in ``merged`` (``identical_first_run_only``): its prompts' identity
    cannot be recounted, and the joined "identical" column would claim every run of them was compared."""
    if not runs:
        raise ValueError("nothing to merge")
    runs, counted = zip(*(count_first_forward(r) for r in runs))
    meta = dict(runs[0]["meta"])
    for r in runs[1:]:
        diff = [k for k in MERGE_KEYS if r["meta"].get(k) != meta.get(k)]
        diff += [k for k in ("methods", "num_draft") if set(r["meta"].get(k) or ()) != set(meta.get(k) or ())]
        diff += ["order"] if run_order(r) != run_order(runs[0]) else []
        if diff:
            raise ValueError(f"runs differ in {', '.join(diff)}: not one comparison")
    rows, seen = [], set()
    for r in runs:
        keys = {(x["set"], x["prompt"]) for x in r["rows"]}
        if keys & seen:
            raise ValueError(f"prompt {sorted(keys & seen)[0]} measured by more than one run")
        seen |= keys
        rows += r["rows"]

    def union(key: str, order) -> list:
        return [v for v in order if any(v in r["meta"][key] for r in runs)]

    meta["sets"] = union("sets", EVAL_SETS)
    meta["methods"] = union("methods", METHODS)
    meta["num_draft"] = sorted({k for r in runs for k in r["meta"]["num_draft"]})
    meta["prompts"] = max(len({x["prompt"] for x in rows if x["set"] == s}) for s in meta["sets"])
    meta.pop("stopped_after", None)
    meta["rounds"] = ROUNDS
    meta["order"] = run_order(runs[0])
    meta["skip"] = min(r["meta"].get("skip", 0) for r in runs)
    meta["merged"] = [{"date": r["meta"].get("date"), "skip": r["meta"].get("skip", 0), "rows": len(r["rows"]),
                       **({"rounds_counted_first_forward": True} if c else {}),
                       **({"identical_first_run_only": True} if identity_first_run_only(r) else {})}
                      for r, c in zip(runs, counted)]
    return {"meta": meta, "summary": summarize(rows, meta["sets"], meta["methods"], meta["num_draft"]), "rows": rows}


def read_run(path) -> dict:
    """A saved run (``--out``'s JSON: an object with ``meta`` and ``rows``); ValueError naming the file otherwise."""
    try:
        run = json.loads(Path(path).read_text())
    except OSError as e:
        raise ValueError(f"{path}: {e.strerror or e}") from None
    except ValueError as e:  # not JSON, or not UTF-8
        raise ValueError(f"{path}: not JSON ({e})") from None
    if not isinstance(run, dict) or not isinstance(run.get("meta"), dict) or not isinstance(run.get("rows"), list):
        raise ValueError(f"{path}: not a saved bench_versus run (a JSON object with 'meta' and 'rows')")
    return run


def labels(meta: dict) -> dict[str, str]:
    """Display names of the methods; ``auto`` says so where it was lookup drafting."""
    out = dict(LABELS)
    if meta.get("same_as", {}).get("auto") == "lookup":
        out["auto"] = "ours (auto = lookup: no drafter ships)"
    elif meta.get("drafter", "auto") != "auto":
        path = Path(meta["drafter"])
        name = path.parent.name if path.name == "drafter" and path.parent.name else path.name  # runs/c8-q4/drafter
        out["auto"] = f"ours (drafter {name}, every round)"
        out["adaptive"] = f"ours (drafter {name}, adaptive schedule)"
    return out


def table(summary: list[dict], meta: dict | None = None) -> str:
    """The summary as a Markdown table."""
    names = labels(meta or {})
    lines = ["| set | method | tok/s | speedup | tau | identical to plain |", "|---|---|---:|---:|---:|---|"]
    for r in summary:
        name = names[r["method"]] + (f" (k={r['k']})" if r["k"] else "")
        lines.append(f"| {r['set']} | {name} | {r['tps']:.2f} | {r['speedup']:.2f}x | {r['tau']:.2f} | "
                     f"{r['identical']}/{r['prompts']} |")
    return "\n".join(lines)


def plot(summary: list[dict], path: Path, meta: dict) -> Path | None:
    """Speedup over plain and tau per set, one bar per method (None without matplotlib, or with nothing to draw)."""
    if not summary:  # no prompt done (matplotlib fails on a legend of no handles)
        return None
    names = labels(meta)
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        import numpy as np
    except ImportError:
        return None
    sets = list(dict.fromkeys(r["set"] for r in summary))
    methods = [m for m in METHODS if any(r["method"] == m for r in summary)]
    width = 0.8 / max(1, len(methods))
    fig, axes = plt.subplots(1, 2, figsize=(11, 3.8))
    for ax, key, ylabel in ((axes[0], "speedup", "speedup over plain mlx_lm (tok/s)"), (axes[1], "tau", "tau (tokens per target forward)")):
        for j, m in enumerate(methods):
            vals, ks = [], []
            for s in sets:
                r = next((r for r in summary if r["set"] == s and r["method"] == m), None)
                vals.append(r[key] if r else 0)
                ks.append(r["k"] if r else None)
            bars = ax.bar(np.arange(len(sets)) + j * width, vals, width, label=names[m])
            if m == "mlx-spec":
                for b, k in zip(bars, ks):
                    if k:
                        ax.annotate(f"k={k}", (b.get_x() + b.get_width() / 2, b.get_height()), ha="center",
                                    va="bottom", fontsize=7)
        ax.set_xticks(np.arange(len(sets)) + width * (len(methods) - 1) / 2, sets)
        ax.axhline(1.0, color="k", lw=0.8)
        ax.set_ylabel(ylabel)
    handles, texts = axes[0].get_legend_handles_labels()
    fig.legend(handles, texts, fontsize=8, loc="lower center", ncol=len(methods))
    fig.suptitle(_title(meta, summary), fontsize=9)
    fig.tight_layout(rect=(0, 0.07, 1, 1))
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def _title(meta: dict, summary: list[dict] = ()) -> str:
    """The run in one line; the prompts per set as run (a run cut short by its time budget or a timeout has fewer
    than ``--prompts``)."""
    counts = sorted({r["prompts"] for r in summary})
    if counts:
        n = str(counts[0]) if len(counts) == 1 else f"{counts[0]}-{counts[-1]}"
    else:
        n = meta["prompts"] if "stopped_after" not in meta else \
            f"{meta['stopped_after']} prompts in all, <= {meta['prompts']}"
    draft = f" vs draft {meta['draft']}" if "mlx-spec" in meta.get("methods", ("mlx-spec",)) else ""
    return f"{meta['target']}{draft} on {meta['device']}: {n} prompts/set, {meta['max_tokens']} tokens, greedy"


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=None, help=f"target (default: the fetched {assets.QWEN_CODER_15B})")
    ap.add_argument("--draft-model", default=None, help=f"mlx-lm's draft model (default: the fetched {assets.QWEN_CODER_05B})")
    ap.add_argument("--sets", type=_csv(str, EVAL_SETS), default=list(EVAL_SETS))
    ap.add_argument("--prompts", type=_positive, default=20, help="the first N prompts of each set")
    ap.add_argument("--skip", type=int, default=0, metavar="K",
                    help="leave out each set's first K prompts (--prompts N then runs prompts K+1 .. K+N): a run "
                         "split over calls, joined by --merge")
    ap.add_argument("--max-tokens", type=_positive, default=256)
    ap.add_argument("--methods", type=_csv(str, METHODS), default=list(DEFAULT_METHODS),
                    help=f"of {','.join(METHODS)} (default {','.join(DEFAULT_METHODS)}; adaptive needs --drafter DIR "
                         "or shipped)")
    ap.add_argument("--num-draft", type=_csv(int), default=[2, 4, 6], help="mlx-lm's num_draft_tokens values")
    ap.add_argument("--repeats", type=_positive, default=1, help="timed runs per request (median)")
    ap.add_argument("--order", choices=("rotate", "fixed"), default="rotate",
                    help="the methods' order per prompt: rotate (a set's i-th prompt, counting --skip's, starts at the "
                         "i-th method, so no method is always the first timed after a prefill) or fixed (plain "
                         "first; runs before session 39)")
    ap.add_argument("--dtype", default="auto", choices=("auto", *FLOAT_DTYPES))
    ap.add_argument("--dequantize", action="store_true", help="expand the target to dense (default: packed)")
    ap.add_argument("--draft-dequantize", action="store_true", help="expand the draft model to dense")
    ap.add_argument("--no-trees", action="store_true", help="our greedy rounds verify chains only (load(trees=False))")
    ap.add_argument("--verify-widths", type=_csv(int), default=[1, 3, 5, 7, 8],
                    help="widths M whose target forward T(M)/T(1) is measured first ('0' skips it)")
    ap.add_argument("--time-budget", type=float, default=None, metavar="MIN",
                    help="start no new prompt after MIN minutes from the start (loading included); the run then "
                         "ends as usual with the prompts done (round-robin over the sets)")
    ap.add_argument("--drafter", default="auto",
                    help="ours' drafter for the auto method: auto (the shipped one; lookup where none ships), shipped, "
                         "or a drafter directory, e.g. one trained but not shipped (its own schedule, as the CLI's)")
    ap.add_argument("--out", default="benchmarks/results/versus.json")
    ap.add_argument("--replot", default=None, metavar="JSON", help="only redraw the plot and table of a saved run")
    ap.add_argument("--merge", nargs="+", default=None, metavar="JSON",
                    help="join saved runs of the same comparison (e.g. --skip 0 and --skip 10) into --out, with its "
                         "table and plot")
    args = ap.parse_args(argv)
    if args.skip < 0:
        ap.error("--skip: must be >= 0")
    if args.merge:
        try:
            merged = merge_runs([read_run(f) for f in args.merge])
        except ValueError as e:
            ap.error(f"--merge: {e}")
        except (KeyError, TypeError) as e:  # a row or meta without a field a saved run has
            ap.error(f"--merge: not saved bench_versus runs ({type(e).__name__}: {e})")
        for f, entry in zip(args.merge, merged["meta"]["merged"]):
            if entry.get("identical_first_run_only"):
                print(f"({f}: saved before session 40, its identity to plain compared only the first of each "
                      f"method's {merged['meta']['repeats']} runs; meta.merged marks it)", file=sys.stderr)
        out = Path(args.out)
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(merged, indent=1) + "\n")
        print(table(merged["summary"], merged["meta"]))
        png = plot(merged["summary"], out.with_suffix(".png"), merged["meta"])
        if png:
            print(f"plot: {png}")
        print(f"results: {out}")
        return
    if args.replot:
        try:
            saved = read_run(args.replot)
        except ValueError as e:
            ap.error(f"--replot: {e}")
        if "summary" not in saved:
            ap.error(f"--replot: {args.replot}: no 'summary' (not a saved bench_versus run)")
        saved, counted = count_first_forward(saved)
        if counted:  # as --merge counts it, and benchmarks/README's corrected tables
            m = saved["meta"]
            saved["summary"] = summarize(saved["rows"], m["sets"], m["methods"], m["num_draft"])
            print("(saved before ours' rounds counted the first token's forward: ours' tau recomputed with it)",
                  file=sys.stderr)
        print(table(saved["summary"], saved["meta"]))
        png = plot(saved["summary"], Path(args.replot).with_suffix(".png"), saved["meta"])
        if png:
            print(f"plot: {png}")
        return
    if any(k < 1 for k in args.num_draft):
        ap.error("--num-draft: each value must be >= 1")
    for s in args.sets:  # (the whole file: past the standard count, e.g. GSM8K's first 200, as --skip reads it)
        n = len(load_eval_set(s, None))
        if args.skip >= n:
            ap.error(f"--skip {args.skip}: {s} has {n} prompts, none left to run")
    if "adaptive" in args.methods and args.drafter == "auto":
        ap.error("--methods adaptive: it runs --drafter DIR or shipped under the adaptive schedule (--drafter auto "
                 "has it already)")
    if args.drafter not in ("auto", "shipped"):
        if "auto" not in args.methods and "adaptive" not in args.methods:
            ap.error("--drafter: it is the auto and adaptive methods' drafter, and --methods leaves both out")
        if not args.drafter.strip() or not Path(args.drafter).is_dir():
            ap.error(f"--drafter: no such drafter directory: {args.drafter!r}")
        try:  # a bad checkpoint fails here, before minutes of loading (as mlx_dflash2.load checks it)
            read_drafter_checkpoint(args.drafter)
            read_draft_vocab(args.drafter)
        except (ValueError, FileNotFoundError) as e:
            ap.error(f"--drafter: {e}")

    def log(msg: str) -> None:
        print(f"[{time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)

    t_start = time.perf_counter()
    target_path = _model_path(args.model, assets.QWEN_CODER_15B, "--model")
    tic = time.perf_counter()
    try:
        target, tok, name = load_target(target_path, dtype=args.dtype, dequantize=args.dequantize)
    except ModelNotFoundError as e:
        ap.error(f"--model: {e}")
    log(f"target {Path(name).name} loaded ({'dense' if args.dequantize else 'packed'}) in {time.perf_counter() - tic:.0f} s")
    draft = None
    if "mlx-spec" in args.methods:
        draft_path = _model_path(args.draft_model, assets.QWEN_CODER_05B, "--draft-model")
        tic = time.perf_counter()
        try:
            draft = load_target(draft_path, dtype=args.dtype, dequantize=args.draft_dequantize)[0]
        except ModelNotFoundError as e:
            ap.error(f"--draft-model: {e}")
        log(f"draft {Path(draft_path).name} loaded in {time.perf_counter() - tic:.0f} s")
    eos = set(tok.eos_token_ids)

    proposers = {}
    same_as = {}
    if "lookup" in args.methods:
        proposers["lookup"] = make_proposer("lookup", target, tok, name)
    if "auto" in args.methods:
        try:
            p = ours_proposer(args.drafter, target, tok, name, args.dequantize, trees=not args.no_trees)
        except (ValueError, FileNotFoundError) as e:  # e.g. a drafter of another target (DrafterConfigError)
            sys.exit(f"bench_versus.py: error: --drafter: {e}")
        lk = proposers.get("lookup")
        if isinstance(p, LookupProposer) and isinstance(lk, LookupProposer) and vars(p) == vars(lk):
            same_as["auto"] = "lookup"  # no drafter ships for this target: auto is lookup drafting
            log("auto: no trained drafter ships for this target, so --drafter auto is lookup drafting "
                f"(B={p.block_size}); measured once, reported as both")
        else:
            proposers["auto"] = p
    if "adaptive" in args.methods:
        try:
            proposers["adaptive"] = ours_proposer(args.drafter, target, tok, name, args.dequantize, adaptive=True,
                                                  trees=not args.no_trees)
        except (ValueError, FileNotFoundError) as e:
            sys.exit(f"bench_versus.py: error: --drafter: {e}")
    if "ours-plain" in args.methods:
        proposers["ours-plain"] = None  # the loop's plain decoding (pipelined, as mlx_lm.generate_step)
    drafter_names = {m: getattr(p, "name", "none" if p is None else str(p)) for m, p in proposers.items()}

    meta = {
        "target": Path(str(name)).name, "draft": Path(str(args.draft_model or assets.QWEN_CODER_05B)).name,
        "dtype": args.dtype, "dequantize": args.dequantize, "draft_dequantize": args.draft_dequantize,
        "device": str(mx.default_device()), "mlx": mx.__version__, "sets": args.sets, "prompts": args.prompts,
        "skip": args.skip, "rounds": ROUNDS,
        "max_tokens": args.max_tokens, "methods": args.methods, "num_draft": args.num_draft,
        "repeats": args.repeats, "order": args.order, "same_as": same_as, "drafters": drafter_names,
        "drafter": args.drafter, "trees": not args.no_trees and bool(getattr(target, "tree_capable", False)),
        "date": time.strftime("%Y-%m-%d %H:%M"),
        "timing": "decode: generated tokens / seconds from the request's start (prompt but its last token "
                  "already cached) to its last token; EOS counted",
    }
    widths = [w for w in args.verify_widths if w > 0]
    if widths:
        from mlx_dflash2.calibrate import measure_verify_costs

        tic = time.perf_counter()
        costs = measure_verify_costs(target, widths, context=32, repeats=1, max_repeats=2, time_budget=30.0,
                                     progress=False)
        meta["verify_cost"] = {str(m): r for m, r in costs.ratios().items()}
        meta["verify_s"] = {str(m): s for m, s in costs.verify_s.items()}
        log(f"target forward cost T(M)/T(1): {costs.table()} (measured in {time.perf_counter() - tic:.0f} s)")

    out_path = Path(args.out)
    out_path.parent.mkdir(parents=True, exist_ok=True)
    rows: list[dict] = []

    def save():
        summary = summarize(rows, args.sets, args.methods, args.num_draft)
        meta["wall_s"] = time.perf_counter() - t_start
        out_path.write_text(json.dumps({"meta": meta, "summary": summary, "rows": rows}, indent=1) + "\n")
        return summary

    # round-robin over the sets, so that a run cut short (the JSON is saved after every prompt) covers each
    per_set = {s: load_eval_set(s, args.skip + args.prompts)[args.skip:] for s in args.sets}
    jobs = prompt_jobs(per_set, args.prompts, args.skip)
    warm = True
    for j, (set_name, prompt, turn) in enumerate(jobs):
        if args.time_budget is not None and time.perf_counter() - t_start > 60 * args.time_budget:
            log(f"time budget of {args.time_budget:g} min spent: stopping after {j} of {len(jobs)} prompts")
            meta["stopped_after"] = j
            break
        ids = tok.apply_chat_template(prompt["messages"], add_generation_prompt=True)
        tic = time.perf_counter()
        # one prefill of the prompt by our loop; its K/V (all but the last token) serves every method (a
        # proposer other than the lookup one, e.g. a trained drafter, needs its own: its session holds features)
        states = {}
        for m, p in list(proposers.items()) or [("plain", None)]:
            states[m] = GenerationState()
            for _ in speculative_generate_step(ids, target, p, max_tokens=1, state=states[m]):
                pass
        tcache = next(iter(states.values())).clone().cache
        _trim_to(tcache, len(ids) - 1)
        dcache = []
        if draft is not None:
            from mlx_lm.models.cache import make_prompt_cache

            dcache = make_prompt_cache(draft.model)
            draft.model(mx.array(ids[:-1], dtype=mx.uint32)[None], cache=dcache)
            mx.eval([c.state for c in dcache])
        log(f"[{j + 1}/{len(jobs)}] {set_name} {prompt['id']}: {len(ids)}-token prompt prefilled in "
            f"{time.perf_counter() - tic:.1f} s")
        if warm:  # first use of each path: allocations and compilation, not timed
            run_mlx(target, draft, ids, tcache, [], 0, 4, eos)
            if draft is not None:
                run_mlx(target, draft, ids, tcache, dcache, max(args.num_draft), 4, eos)
            for m, p in proposers.items():
                run_ours(target, p, ids, states[m], 4, eos)
            warm = False

        todo = [("plain", 0)] + [("mlx-spec", k) for k in args.num_draft if draft is not None]
        todo += [(m, 0) for m in proposers]
        fixed = list(todo)  # the rows' order in the JSON
        if args.order == "rotate":
            todo = method_order(todo, turn)
        plain_row = None
        done: list[tuple[dict, list[dict]]] = []  # (row, its aliases), in the order run
        for method, k in todo:
            runs = []
            for _ in range(args.repeats):
                if method in ("plain", "mlx-spec"):
                    toks, secs, rounds = run_mlx(target, draft, ids, tcache, dcache if k else [], k,
                                                 args.max_tokens, eos)
                else:
                    toks, secs, rounds, _ = run_ours(target, proposers[method], ids, states[method],
                                                     args.max_tokens, eos)
                runs.append((secs, toks, rounds))
            secs = statistics.median(r[0] for r in runs)
            toks, rounds = runs[0][1], runs[0][2]
            row = {"set": set_name, "prompt": prompt["id"], "prompt_tokens": len(ids), "method": method,
                   "k": k or None, "tokens": len(toks), "rounds": rounds, "seconds": secs,
                   "tps": len(toks) / secs, "tau": len(toks) / max(1, rounds), "tokens_out": toks}
            if args.repeats > 1:  # the first run's tokens are saved: every other run must have given them too
                row["repeats_agree"] = all(r[1] == toks for r in runs[1:])
                if not row["repeats_agree"]:
                    log(f"[{j + 1}/{len(jobs)}] {set_name} {prompt['id']} {method_label(meta, row)}: its "
                        f"{args.repeats} runs gave different tokens")
            if method == "plain":
                plain_row = row
            aliases = [{"method": alias, "measured_as": method} for alias, m in same_as.items() if m == method]
            done.append((row, aliases))  # (the same run stands for the method that resolved to it)
            vs = f" ({row['tps'] / plain_row['tps']:.2f}x plain)" if plain_row else ""
            log(f"[{j + 1}/{len(jobs)}] {set_name} {prompt['id']} {method_label(meta, row)}: "
                f"{len(toks)} tokens in {secs:.1f} s = {row['tps']:.2f} tok/s{vs}, tau {row['tau']:.2f}")
        ref = plain_row["tokens_out"]
        by_method = {(r["method"], r["k"] or 0): (r, a) for r, a in done}
        for row, aliases in (by_method[m] for m in fixed):  # saved in the fixed order, whatever order they ran in
            toks = row["tokens_out"]
            # identical: every run of this method gave plain's tokens, and plain's runs agree among themselves
            row["identical"] = (toks == ref and row.get("repeats_agree", True)
                                and plain_row.get("repeats_agree", True))
            rows.append(row)
            rows.extend({**row, **a} for a in aliases)
            if not row["identical"]:
                at = next((i for i, (a, b) in enumerate(zip(toks, ref)) if a != b), min(len(toks), len(ref)))
                why = f"differs at token {at}" if toks != ref else "the runs of one of them differ"
                log(f"[{j + 1}/{len(jobs)}] {set_name} {prompt['id']} {method_label(meta, row)}: NOT identical to "
                    f"plain ({why})")
        others = [r for r, _ in done if r is not plain_row]  # (plain is its own reference: not counted)
        if others:
            log(f"[{j + 1}/{len(jobs)}] {set_name} {prompt['id']}: "
                + ", ".join(f"{method_label(meta, r)} {r['tps'] / plain_row['tps']:.2f}x" for r in others)
                + f"; {sum(r['identical'] for r in others)} of {len(others)} identical to plain")
        save()

    summary = save()
    print(f"\n{_title(meta, summary)}; wall {meta['wall_s'] / 60:.1f} min")
    if "verify_cost" in meta:
        print("target T(M)/T(1): " + " ".join(f"{m}:{r:.2f}" for m, r in meta["verify_cost"].items()))
    print(table(summary, meta))
    png = plot(summary, out_path.with_suffix(".png"), meta)
    if png:
        print(f"plot: {png}")
    print(f"results: {out_path}")


if __name__ == "__main__":
    main()
