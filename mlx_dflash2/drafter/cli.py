"""``mlx_dflash2.drafter``: create or inspect drafter checkpoints.

    mlx_dflash2.drafter init --out DIR [--model TARGET] [--architecture DFlash2DraftModel]
                             [--num-layers 2] [--num-taps N] [--block-size 16] [--selector-rank 64] ...
    mlx_dflash2.drafter info DIR|shipped [--model TARGET]

``init`` writes a freshly initialised drafter for the target (DFlash2's conv
and selector as exact no-ops), the starting point of training (``--init``).
Its flags have the names of ``mlx_dflash2.train fit`` (``--architecture``,
``--num-layers``, ``--num-taps``); the older ``--arch``, ``--layers`` and
``--taps`` still work (hidden aliases).
``info`` loads a checkpoint against the target (all validation included) and
prints its configuration.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn


def _target(args):
    from ..loading import load_target

    target, tokenizer, name = load_target(args.model)
    return target, tokenizer, name


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="mlx_dflash2.drafter", description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    i = sub.add_parser("init", help="write a freshly initialised drafter for a target")
    i.add_argument("--out", "-o", required=True, help="output checkpoint directory")
    i.add_argument("--model", default=None, help="target (default: the embedded SmolLM2-135M-Instruct)")
    archs = ["DFlash2DraftModel", "DFlashDraftModel"]
    i.add_argument("--architecture", choices=archs, default="DFlash2DraftModel")
    i.add_argument("--num-layers", type=int, default=2, help="drafter decoder layers")
    i.add_argument("--num-taps", type=int, default=None,
                   help="number of target taps (default: one per layer, at most one per target layer)")
    # the names before they matched `mlx_dflash2.train fit`'s, kept working but not shown
    i.add_argument("--arch", dest="architecture", choices=archs, default=argparse.SUPPRESS, help=argparse.SUPPRESS)
    i.add_argument("--layers", dest="num_layers", type=int, default=argparse.SUPPRESS, help=argparse.SUPPRESS)
    i.add_argument("--taps", dest="num_taps", type=int, default=argparse.SUPPRESS, help=argparse.SUPPRESS)
    i.add_argument("--target-layer-ids", type=json.loads, default=None, help="explicit tap ids, JSON list")
    i.add_argument("--block-size", type=int, default=16)
    i.add_argument("--intermediate-size", type=int, default=None)
    i.add_argument("--selector-rank", type=int, default=64)
    i.add_argument("--selector-top-k", type=int, default=16)
    i.add_argument("--mask-token-id", type=int, default=None)
    i.add_argument("--dtype", choices=["float32", "bfloat16", "float16"], default="bfloat16")
    i.add_argument("--seed", type=int, default=0)
    i.add_argument("--overwrite", action="store_true")
    f = sub.add_parser("info", help="load a checkpoint against its target and print its config")
    f.add_argument("path", help="checkpoint directory, or 'shipped' (the drafter shipped for the embedded target)")
    f.add_argument("--model", default=None)
    args = p.parse_args(argv)

    from . import DrafterConfigError, DrafterLoadError, init_drafter, load_drafter, save_drafter
    from .model import param_count

    try:
        target, tokenizer, name = _target(args)
        if args.cmd == "init":
            model = init_drafter(
                target,
                tokenizer,
                architecture=args.architecture,
                num_layers=args.num_layers,
                block_size=args.block_size,
                num_taps=args.num_taps,
                target_layer_ids=args.target_layer_ids,
                mask_token_id=args.mask_token_id,
                intermediate_size=args.intermediate_size,
                selector_rank=args.selector_rank,
                selector_top_k=args.selector_top_k,
                seed=args.seed,
            )
            dtype = getattr(mx, args.dtype)
            from mlx.utils import tree_map

            model.update(tree_map(lambda a: a.astype(dtype), model.parameters()))
            path = save_drafter(model, args.out, overwrite=args.overwrite)
            print(f"wrote {model.config.architecture} ({param_count(model) / 1e6:.2f}M parameters) to {path}")
            taps = list(model.config.target_layer_ids)
            asked = args.num_taps or (None if args.target_layer_ids else args.num_layers)
            if asked and len(taps) < asked:
                print(f"note: {asked} taps asked, {len(taps)} made: the target has {target.num_layers} layer(s) and "
                      f"each is tapped at most once (target_layer_ids {taps})")
        else:
            from ..loading import resolve_shipped

            path = resolve_shipped(args.path, name)
            model = load_drafter(path, target, tokenizer)
            print(json.dumps(model.config.to_dict(), indent=2))
            print(f"parameters: {param_count(model) / 1e6:.2f}M")
            from .io import read_draft_vocab

            vocab = read_draft_vocab(path)
            print(f"draft vocabulary: {len(set(vocab)):,} ids (draft_vocab.json; --draft-vocab full: every id)"
                  if vocab else "draft vocabulary: none (the drafter proposes from every id)")
            raw = json.loads((Path(path) / "config.json").read_text())
            q, cq = raw.get("quantization"), raw.get("codebook_quantization")
            mods = [m for _, m in model.named_modules() if isinstance(m, (nn.Linear, nn.QuantizedLinear))]
            nq = sum(isinstance(m, nn.QuantizedLinear) for m in mods)
            layers = "float" if not nq else f"{q['bits']}-bit g{q['group_size']}" + (
                f" ({nq} of {len(mods)}; the others float)" if nq < len(mods) else "")
            books = ("" if model.config.architecture != "DFlash2DraftModel"  # (a v1's stray block names nothing)
                     else f", selector codebooks {cq['bits']}-bit g{cq['group_size']} (expanded at load)" if cq
                     else ", selector codebooks float")
            size = sum(f.stat().st_size for f in Path(path).glob("*.safetensors"))
            print(f"weights: linear layers {layers}{books}; {size / 1e6:.1f} MB on disk")
    except (DrafterConfigError, DrafterLoadError, FileNotFoundError, FileExistsError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
