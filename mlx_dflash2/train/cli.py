"""``mlx_dflash2.train``: build data, train / fine-tune, and evaluate drafters.

    mlx_dflash2.train prompts --out data/prompts.jsonl            # decontaminated training prompts
    mlx_dflash2.train regen   --prompts data/prompts.jsonl --out data/responses   # target answers them
    mlx_dflash2.train fit     --data data/responses --out runs/d2 [--init DRAFTER] [--steps N]
    mlx_dflash2.train eval    --drafter runs/d2/drafter [--sets humaneval,mtbench,gsm8k] [--block-sizes 4,8,16]

Fine-tuning on your own prompts: ``regen --prompts my_prompts.jsonl`` (JSONL
rows with ``messages``/``prompt``/``text``, or a text file with one prompt per
line), then ``fit --init path/to/drafter``. ``fit`` resumes from the run
directory's latest checkpoint unless ``--no-resume``.
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import fields
from pathlib import Path

from .trainer import TrainConfig


def _target(args):
    from ..loading import load_target, shipped_drafter_path

    target, tokenizer, name = load_target(args.model, dtype=args.dtype, dequantize=args.dequantize)
    if getattr(args, "init", None) == "shipped":
        path = shipped_drafter_path(name)
        if path is None:
            raise FileNotFoundError(f"--init shipped: no drafter is shipped for the target {name!r}")
        args.init = str(path)
    return target, tokenizer


def _add_target_args(p):
    p.add_argument("--model", default=None, help="target (default: the embedded SmolLM2-135M-Instruct)")
    p.add_argument("--dtype", default="auto", help="target dtype for scales/non-packed weights (auto: float32 on CPU)")
    p.add_argument("--dequantize", action="store_true", help="run the target dense (more memory)")


def _numbers(flag: str, text: str, kind=float) -> list:
    """``"0,0.7"`` -> ``[0.0, 0.7]`` (``kind`` int or float); a ValueError naming ``flag`` otherwise."""
    try:
        return [kind(x) for x in text.split(",")]
    except ValueError:
        raise ValueError(f"{flag} {text!r}: expected comma-separated {kind.__name__}s") from None


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="mlx_dflash2.train", description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    sub = ap.add_subparsers(dest="cmd", required=True)

    p = sub.add_parser("prompts", help="write decontaminated training prompts (ShareGPT, code, math)")
    p.add_argument("--out", required=True)
    p.add_argument("--sharegpt", type=int, default=12000)
    p.add_argument("--code", type=int, default=4000)
    p.add_argument("--math", type=int, default=4000)
    p.add_argument("--sharegpt-turns", type=int, default=0,
                   help="later ShareGPT turns, each with the conversation before it")
    p.add_argument("--code-api", type=int, default=0,
                   help="code prompts from the functions and methods of the whole standard library")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--cache-dir", default=".cache/train")

    r = sub.add_parser("regen", help="answer prompts with the target (resumable shards)")
    _add_target_args(r)
    r.add_argument("--prompts", required=True, help="prompts file (see mlx_dflash2.train.data.read_prompt_file)")
    r.add_argument("--out", required=True)
    r.add_argument("--max-tokens", type=int, default=256)
    r.add_argument("--batch-size", type=int, default=256)
    r.add_argument("--shard-size", type=int, default=1024)
    r.add_argument("--temp-fraction", type=float, default=0.0, help="fraction answered by sampling at --temp")
    r.add_argument("--temp", type=float, default=0.7)
    r.add_argument("--temps", default=None,
                   help="answer every prompt once per temperature, e.g. 0,0.7,1.0 (overrides --temp-fraction)")
    r.add_argument("--skip", type=int, default=0, help="skip the first N prompts (e.g. answered in an earlier run)")
    r.add_argument("--limit", type=int, default=None, help="use N prompts (after --skip)")
    r.add_argument("--seed", type=int, default=0)
    r.add_argument("--time-budget", type=float, default=None, help="stop between shards after this many seconds")

    f = sub.add_parser("fit", help="train or fine-tune a drafter")
    _add_target_args(f)
    for fld in fields(TrainConfig):
        if fld.name in ("extra",):
            continue
        name = "--" + fld.name.replace("_", "-")
        default = getattr(TrainConfig(), fld.name)
        if fld.name in ("data", "out"):
            f.add_argument(name, required=True)
        elif isinstance(default, bool) and default:
            f.add_argument("--no-" + fld.name.replace("_", "-"), dest=fld.name, action="store_false",
                           help=f"turn off {fld.name} (on by default)")
        elif isinstance(default, bool):
            f.add_argument(name, action="store_true")
        elif fld.name == "target_layer_ids":
            f.add_argument(name, type=json.loads, default=None)
        elif fld.name in ("init",):
            f.add_argument(name, default=None, help="existing drafter (DFlash or DFlash2) to fine-tune, or 'shipped' "
                           "(the drafter shipped for the embedded target)")
        else:
            typ = type(default) if default is not None else (float if fld.name in ("gamma",) else int)
            f.add_argument(name, type=typ, default=default)
    f.add_argument("--no-resume", action="store_true", help="ignore existing checkpoints in --out")
    f.add_argument("--max-steps", type=int, default=None, help="stop after this many steps (resume later)")

    e = sub.add_parser("eval", help="tau on held-out prompt sets (exact greedy replay) + plot")
    _add_target_args(e)
    e.add_argument("--drafter", action="append", required=True, help="LABEL=PATH or PATH (repeatable)")
    e.add_argument("--sets", default="humaneval,mtbench,gsm8k")
    e.add_argument("--block-sizes", default="4,8,16")
    e.add_argument("--max-tokens", type=int, default=256)
    e.add_argument("--limit", type=int, default=-1, help="prompts per set (-1: the standard counts)")
    e.add_argument("--lookup", action="store_true", help="fuse lookup proposals (as the default product does)")
    e.add_argument("--cache-dir", default=".cache/eval")
    e.add_argument("--out", default="benchmarks/results/tau.json")
    args = ap.parse_args(argv)

    try:
        if args.cmd == "prompts":
            from .data import build_prompts

            print(json.dumps(build_prompts(args.out, args.sharegpt, args.code, args.math, args.seed, args.cache_dir,
                                            args.sharegpt_turns, args.code_api)))
        elif args.cmd == "regen":
            from .data import read_prompt_file
            from .regen import check_regen_args, regenerate

            if args.skip < 0 or (args.limit is not None and args.limit < 1):
                raise ValueError("--skip must be >= 0 and --limit >= 1")
            temps = _numbers("--temps", args.temps) if args.temps else None
            check_regen_args(args.out, args.max_tokens, args.batch_size, args.shard_size, temps)  # before loading
            prompts = read_prompt_file(args.prompts)
            if not prompts:
                raise ValueError(f"{args.prompts}: no prompts")
            prompts = prompts[args.skip :]
            prompts = prompts[: args.limit] if args.limit is not None else prompts
            if not prompts:
                raise ValueError(f"{args.prompts}: no prompts left after --skip {args.skip}")
            target, tok = _target(args)
            st = regenerate(target, tok, prompts, args.out, args.max_tokens, args.batch_size, args.shard_size,
                            args.temp_fraction, args.temp, seed=args.seed,
                            time_budget=args.time_budget,
                            temps=temps)
            print(json.dumps(st))
        elif args.cmd == "fit":
            from .trainer import Trainer

            if not Path(args.data).exists():
                raise FileNotFoundError(f"--data {args.data}: no such file or directory")
            target, tok = _target(args)  # resolves --init shipped
            cfg = TrainConfig(**{fl.name: getattr(args, fl.name) for fl in fields(TrainConfig) if fl.name != "extra"})
            tr = Trainer(cfg, target, tok)
            last = tr.fit(resume=not args.no_resume, max_steps=args.max_steps)
            print(json.dumps({"step": tr.step, "total_steps": tr.total_steps, **last}))
        else:
            from ..drafter import load_drafter
            from ..loading import _default_dtype
            from .evaluate import evaluate_sets, plot_acceptance, write_report

            from .data import load_eval_set

            blocks = _numbers("--block-sizes", args.block_sizes, int)
            if any(b < 2 for b in blocks):
                raise ValueError("--block-sizes must be >= 2")
            if args.limit is not None and args.limit != -1 and args.limit < 1:
                raise ValueError("--limit must be -1 (the standard counts) or >= 1")
            for name in args.sets.split(","):
                load_eval_set(name, 1)  # KeyError names the known sets
            target, tok = _target(args)
            drafters = {}
            for spec in args.drafter:
                label, _, path = spec.rpartition("=")
                model = load_drafter(path, target, tok, dtype=_default_dtype())
                drafters[label or model.config.architecture] = model
            rep = evaluate_sets(target, tok, drafters, args.sets.split(","),
                                blocks, args.max_tokens,
                                None if args.limit is None else args.limit, args.cache_dir, lookup=args.lookup)
            out = write_report(rep, args.out)
            png = plot_acceptance(rep, out.with_suffix(".png"))
            print(f"{'set':10} {'drafter':12} {'B':>3} {'tau':>6}")
            for r in rep["results"]:
                print(f"{r['set']:10} {r['drafter']:12} {r['block_size']:>3} {r['tau']:>6.3f}")
            print(f"report: {out}" + (f"\nplot: {png}" if png else ""))
    except (OSError, ValueError, KeyError) as err:
        msg = err.args[0] if isinstance(err, KeyError) and err.args else err
        print(f"error: {msg}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
