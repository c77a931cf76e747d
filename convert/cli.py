"""``mlx_dflash2.convert``: command line of the checkpoint converter.

    mlx_dflash2.convert SRC DEST [--from FORMAT] [--q-bits 4] [--q-group-size 64]
                        [--dtype float16|bfloat16|float32] [--q-override REGEX=BITS[:GROUP]|none ...]
                        [--requantize | --keep-source-layout] [--no-quantize] [--overwrite] [--report-error]
                        [--target MODEL] [--codebook-bits 4|8|none]

SRC is a checkpoint directory, a .gguf file or a Hugging Face hub id (resolved
offline when cached). The format is detected from config.json's
quantization_config or the file type; --from forces it.

A quantized source keeps its own layout where MLX has an exact form of it
(GPTQ/AWQ groups, GGUF Q4_0/Q4_1/Q5_0/Q5_1/Q8_0/Q4_K/Q5_K blocks); --q-bits /
--q-group-size ask for another layout (layers that differ are requantized, with
a note), --requantize takes the --q-bits/--q-group-size spec (default 4-bit g64)
everywhere. --keep-source-layout is the default (kept so that old commands work;
with --q-bits/--q-group-size it keeps the source layout and applies the spec to
the other layers only).
"""

from __future__ import annotations

import argparse
import json
import sys

from .errors import ConvertError
from .mlxq import parse_override
from .pipeline import DTYPES, FORMATS


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="mlx_dflash2.convert",
        description="Convert HF (bf16/fp16), GPTQ, AWQ, GGUF, EXL3 checkpoints and DFlash/DFlash2 "
        "drafters to MLX: a quantized source keeps its own layout where MLX has an exact form of it, other "
        "layers become 4-bit affine, group 64 (--q-bits/--q-group-size, --requantize).",
    )
    p.add_argument("src", help="checkpoint directory, .gguf file or Hugging Face hub id")
    p.add_argument("dest", help="output directory (must not exist unless --overwrite)")
    p.add_argument("--from", dest="from_format", choices=FORMATS, default=None, help="force the input format")
    p.add_argument("--q-bits", type=int, default=None,
                   help="MLX affine bits (2, 3, 4, 5, 6, 8; default 4 for layers without an exact source layout). "
                   "Given, it asks for that layout: layers of a quantized source whose layout differs are requantized")
    p.add_argument("--q-group-size", type=int, default=None,
                   help="MLX affine group size (32, 64, 128; default 64, as --q-bits)")
    p.add_argument("--no-quantize", action="store_true", help="write float weights in --dtype instead")
    p.add_argument("--dtype", choices=DTYPES, default=None, help="float dtype of unquantized tensors and scales")
    p.add_argument(
        "--q-override",
        action="append",
        default=[],
        metavar="REGEX=BITS[:GROUP]|none",
        help="per-layer override, regex searched in the module path; repeatable, last match wins "
        "(e.g. 'embed_tokens=8' 'lm_head=8' 'mlp.gate$=none')",
    )
    layout = p.add_mutually_exclusive_group()
    layout.add_argument(
        "--requantize",
        dest="keep_source_layout",
        action="store_false",
        default=None,
        help="give every layer the --q-bits/--q-group-size spec (default 4-bit g64), requantizing layers whose "
        "source layout differs (a second rounding). Default: keep the source's exact layout where one exists",
    )
    layout.add_argument(
        "--keep-source-layout",
        dest="keep_source_layout",
        action="store_true",
        help="the default: keep the source's exact quantized layout where one exists (GPTQ/AWQ groups; an "
        "MLX-quantized drafter's own; GGUF "
        "Q4_0/Q4_1/Q5_0/Q5_1/Q8_0/Q4_K/Q5_K as MLX groups of 32): lossless, except that Q4_K/Q5_K scales are exact "
        "only with --dtype float32; GGUF Q6_K becomes 8-bit g32 (near-lossless); Q2_K/Q3_K take the --q-bits spec. "
        "With --q-bits/--q-group-size it keeps the layout and applies them to the other layers only",
    )
    p.add_argument("--overwrite", action="store_true", help="replace DEST if it exists")
    p.add_argument("--shard-size-gb", type=float, default=2.0, help="maximum shard size (GiB, default 2)")
    p.add_argument("--report-error", action="store_true", help="print each layer's relative error vs the source")
    p.add_argument("--target", default=None, help="drafters: validate against this target model")
    p.add_argument("--codebook-bits", choices=("4", "8", "none"), default=None,
                   help="DFlash2 drafters: store the selector's two [vocab, rank] codebooks MLX-quantized at these "
                   "bits (group 32; a third of a 4-bit drafter for a 152k vocabulary); loading expands them; "
                   "none: in the float --dtype. Default: as the source stores them (float with --no-quantize)")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    return p


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    from .pipeline import convert

    if not args.shard_size_gb > 0:
        print("error: --shard-size-gb must be > 0", file=sys.stderr)
        return 2
    try:
        overrides = [parse_override(o) for o in args.q_override]
        res = convert(
            args.src,
            args.dest,
            from_format=args.from_format,
            quantize=not args.no_quantize,
            q_bits=args.q_bits,
            q_group_size=args.q_group_size,
            dtype=args.dtype,
            overrides=overrides,
            keep_source_layout=args.keep_source_layout,
            overwrite=args.overwrite,
            shard_bytes=int(args.shard_size_gb * (1 << 30)),
            progress=not args.quiet,
            measure_error=args.report_error,
            target=args.target,
            codebook_bits=None if args.codebook_bits is None else 0 if args.codebook_bits == "none"
            else int(args.codebook_bits),
        )
    except ConvertError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    for n in res.notes:
        print(f"note: {n}", file=sys.stderr)
    if args.report_error and res.layer_errors:
        for k, v in res.layer_errors.items():
            print(f"  {k:60s} rel.err {v:.4%}")
        print(f"total relative error vs source: {res.total_error:.4%}")
    print(
        json.dumps(
            {
                "output": str(res.path),
                "format": res.format,
                "tensors": res.tensors,
                "weights": res.weights,
                "exact_layers": len(res.exact),
                "rounded_layers": len(res.rounded),
                "requantized_layers": len(res.requantized),
                "seconds": round(res.seconds, 2),
                "weights_per_s": round(res.weights / res.seconds) if res.seconds else None,
            }
        )
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
