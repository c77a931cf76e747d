"""The ``mlx_dflash2.generate`` command (also ``python -m mlx_dflash2.generate``).

Flags follow ``mlx_lm.generate``. Streams the answer of the target through the
speculative loop; ``--verbose`` prints the statistics (tokens/s, acceptance
length tau, acceptance by block position) after it.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from .api import GenerationResponse, _consume, generate, stream_generate
from .sampling import SamplingParams
from .loading import (ADAPTIVE_HELP, DRAFTER_KEYWORDS, CALIBRATE_HELP, DRAFT_CONFIDENCE_HELP, DRAFTER_HELP, DRAFTER_WINDOW_HELP,
                      DRAFT_VOCAB_HELP, KERNELS_HELP, check_block_size, draft_confidence_arg, drafter_window_arg, load)

__all__ = ["main", "generate", "stream_generate", "GenerationResponse"]


# ----------------------------------------------------------------------------


def setup_arg_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="mlx_dflash2.generate",
        description="Generate text with DFlash2 speculative decoding (lossless against plain decoding).",
    )
    p.add_argument("--model", default=None, help="target: a GGUF file, an mlx-lm directory or hub id "
                   "(default: the embedded SmolLM2-135M-Instruct)")
    p.add_argument("--drafter", "--draft-model", default="auto", help=DRAFTER_HELP)
    p.add_argument("--no-lookup", action="store_true", help="do not fuse lookup proposals with the drafter's")
    p.add_argument("--no-trees", action="store_true",
                   help="greedy requests verify the drafter's chain only, not a tree of its candidates (same output)")
    p.add_argument("--draft-confidence", type=draft_confidence_arg, default=None, metavar="C",
                   help=DRAFT_CONFIDENCE_HELP)
    p.add_argument("--drafter-window", type=drafter_window_arg, default=None, metavar="N",
                   help=DRAFTER_WINDOW_HELP)
    p.add_argument("--draft-vocab", choices=["auto", "full"], default=None, help=DRAFT_VOCAB_HELP)
    p.add_argument("--adaptive", action=argparse.BooleanOptionalAction, default=None, help=ADAPTIVE_HELP)
    p.add_argument("--calibrate", action=argparse.BooleanOptionalAction, default=None, help=CALIBRATE_HELP)
    p.add_argument("--prompt", "-p", default="Hello!", help="the prompt ('-' reads stdin)")
    p.add_argument("--system", default=None, help="system prompt (chat template)")
    p.add_argument("--max-tokens", "-m", type=int, default=256,
                   help="maximum tokens to generate (-1: no limit but the context)")
    p.add_argument("--block-size", "--num-draft-tokens", type=int, default=None,
                   help="block size B (verify width); default the drafter's")
    p.add_argument("--temp", type=float, default=0.0, help="sampling temperature (0 = greedy)")
    p.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling threshold")
    p.add_argument("--top-k", type=int, default=0, help="top-k sampling (0 = off)")
    p.add_argument("--min-p", type=float, default=0.0, help="min-p sampling threshold (0 = off)")
    p.add_argument("--repetition-penalty", type=float, default=None, help="repetition penalty (e.g. 1.1)")
    p.add_argument("--repetition-context-size", type=int, default=20, help="tokens the penalty looks back on")
    p.add_argument("--seed", type=int, default=None, help="random seed (reproducible sampling)")
    p.add_argument("--stop", action="append", default=None, help="stop string (repeatable)")
    p.add_argument("--chat-template-args", type=_json_object, default={},
                   help='JSON object of extra chat template arguments, e.g. \'{"enable_thinking": false}\'')
    p.add_argument("--ignore-chat-template", action="store_true", help="feed the prompt as raw text")
    p.add_argument("--dtype", choices=["auto", "float32", "float16", "bfloat16"], default="auto",
                   help="dtype of non-packed weights/scales (auto: float32 on CPU)")
    p.add_argument("--dequantize", action=argparse.BooleanOptionalAction, default=None,
                   help="expand quantized weights (target and drafter) to dense --dtype (default: only on "
                   "the CPU backend for a target whose dense weights fit in 40%% of the memory, where quantized "
                   "matmuls are slow)")
    p.add_argument("--kernels", choices=["auto", "reference", "kernel"], default=None, help=KERNELS_HELP)
    p.add_argument("--prefill-step-size", type=int, default=2048, help="prompt chunk size")
    p.add_argument("--verbose", action="store_true", help="print the statistics after the text")
    p.add_argument("--compare", action="store_true",
                   help="then decode the same prompt plainly (no drafter, same settings) and print both speeds, "
                   "the speedup and whether the outputs are identical")
    return p


def _json_object(text: str) -> dict:
    """argparse type of ``--chat-template-args``: a JSON object.

    Raises:
        argparse.ArgumentTypeError: not JSON, or JSON that is not an object.
    """
    try:
        value = json.loads(text)
    except json.JSONDecodeError as e:
        raise argparse.ArgumentTypeError(f"not valid JSON ({e.msg} at character {e.pos}): {text!r}; "
                                         'expected an object such as \'{"enable_thinking": false}\'') from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError(f"must be a JSON object such as '{{\"enable_thinking\": false}}', "
                                         f"got {text!r}")
    return value


def _check_args(args) -> None:
    """Every flag that can be checked without the weights, before the (slow) loading.

    Raises:
        ValueError: naming the flag.
    """
    if args.max_tokens == 0 or args.max_tokens < -1:
        raise ValueError("--max-tokens must be positive (or -1 for no limit)")
    if args.block_size is not None:
        check_block_size(args.block_size)
    if args.prefill_step_size < 1:
        raise ValueError(f"--prefill-step-size must be >= 1, got {args.prefill_step_size}")
    if args.repetition_context_size < 1:
        raise ValueError(f"--repetition-context-size must be >= 1, got {args.repetition_context_size}")
    SamplingParams(temp=args.temp, top_p=args.top_p, top_k=args.top_k, min_p=args.min_p,
                   repetition_penalty=args.repetition_penalty, seed=args.seed).validate()
    d = args.drafter
    if d not in DRAFTER_KEYWORDS and not Path(d).expanduser().is_dir():
        raise ValueError(f"--drafter: drafter checkpoint directory not found: {d} (or one of auto, shipped, "
                         "lookup, none, init)")


def _build_prompt(args, tokenizer) -> list[int]:
    prompt = sys.stdin.read() if args.prompt == "-" else args.prompt
    prompt = prompt.replace("\\n", "\n") if args.prompt != "-" else prompt
    if args.ignore_chat_template or not getattr(tokenizer, "has_chat_template", False):
        add_special = tokenizer.bos_token is None or not prompt.startswith(tokenizer.bos_token)
        return tokenizer.encode(prompt, add_special_tokens=add_special)
    messages = []
    if args.system is not None:
        messages.append({"role": "system", "content": args.system})
    messages.append({"role": "user", "content": prompt})
    return tokenizer.apply_chat_template(messages, add_generation_prompt=True, **args.chat_template_args)


def _shipped_drafter_in_use(drafter_arg: str, model):
    """The directory of the shipped drafter that ``--drafter auto`` / ``shipped`` put in ``model``'s proposer, or
    None (another drafter, lookup alone, plain decoding, or a target no drafter ships for)."""
    if drafter_arg not in ("auto", "shipped") or model.proposer is None or model.proposer.name == "lookup":
        return None
    from .loading import shipped_drafter_path

    return shipped_drafter_path(model.name)


def main(argv=None) -> int:
    args = setup_arg_parser().parse_args(argv)
    try:
        _check_args(args)
        model, tokenizer = load(
            args.model,
            args.drafter,
            dtype=args.dtype,
            dequantize=args.dequantize,
            block_size=args.block_size,
            lookup=not args.no_lookup,
            draft_confidence=args.draft_confidence,
            adaptive=args.adaptive,
            kernels=args.kernels,
            calibrate=args.calibrate,
            drafter_window=args.drafter_window,
            draft_vocab=args.draft_vocab,
            trees=not args.no_trees,
            names="cli",  # its errors name the flags (--no-lookup), not load()'s arguments
        )
        prompt = _build_prompt(args, tokenizer)
        kwargs = dict(
            max_tokens=args.max_tokens,
            temp=args.temp,
            top_p=args.top_p,
            top_k=args.top_k,
            min_p=args.min_p,
            repetition_penalty=args.repetition_penalty,
            repetition_context_size=args.repetition_context_size,
            seed=args.seed,
            stop=args.stop,
            prefill_step_size=args.prefill_step_size,
        )
        text, stats = _consume(stream_generate(model, tokenizer, prompt, **kwargs), echo=True,
                               show_stats=args.verbose, return_stats=True)
        if args.verbose:  # which weights ran (the CPU rule's choice shows otherwise only in speed and memory)
            q = model.target.config.get("quantization")
            print(f"Target weights: {'packed %s-bit' % q.get('bits', '?') if isinstance(q, dict) else 'dense'}"
                  + (" (expanded by the CPU rule; --no-dequantize keeps them packed)"
                     if getattr(model.target, "cpu_rule_dense", False) else ""))
            shipped = _shipped_drafter_in_use(args.drafter, model)
            if shipped is not None:
                print(f"Drafter weights: shipped for {shipped.name} ({shipped})")
        if args.compare:
            print(_compare(model, tokenizer, prompt, kwargs, text, stats))
    except (NotImplementedError, ValueError, FileNotFoundError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:  # Ctrl-C: one line, not a traceback from inside a loader or the loop
        print("\ninterrupted", file=sys.stderr)
        return 130
    return 0


def _compare(model, tokenizer, prompt, kwargs, text: str, stats) -> str:
    """Decode ``prompt`` plainly with the same settings; a line comparing speed and output."""
    plain_text, plain = _consume(stream_generate(model, tokenizer, prompt, drafter="none", **kwargs), echo=False,
                                 show_stats=False, return_stats=True)
    same = "identical" if plain_text == text else "DIFFERENT"
    if kwargs["temp"] > 0:
        same += " (sampled: equal in distribution, not token for token)"
    speed = f"{stats.decode_tps / plain.decode_tps:.2f}x" if plain.decode_tps > 0 and stats.decode_tps > 0 else "n/a"
    return (f"Plain decoding (no drafter, same settings): {plain.generated_tokens} tokens, "
            f"{plain.decode_tps:.2f} tokens-per-sec; speculative {stats.decode_tps:.2f} tokens-per-sec: "
            f"speedup {speed}; output {same}")


if __name__ == "__main__":
    sys.exit(main())
