"""Issue 22 through the real server at a memory-bound shape: our server with a scripted drafter of fixed acceptance
against plain batching (ours, and ``mlx_lm.server``) on a random-weight Qwen3-8B-shaped target. Speed only.

A 135M target on a GPU is bound by the host's launches, so batching drafts there buys little; what users serve
(8B-27B) is bound by reading the weights, where a verify of 8 rows x 4 tokens costs about one step. Trained
drafters of that size cannot come here (no model hub), so the drafter is a script: each request's proposals are
its own greedy continuation (computed once, plain and batched, at the server's start for ``bench_server.py``'s
prompt pool) with the first error at block offset ``tau - 1`` in every round (a full-width round emits ``tau``
tokens; no drafter forward: a round costs the verify, the accept and the loop's bookkeeping). Where a batched
row's own output leaves its reference (bf16 near-ties of random weights), its later drafts are rejected: the
measured tau says so.

Two subcommands:

* ``make DIR --tokenizer MLX_DIR [--shape qwen3-8b]``: writes a random-weight, 4-bit (group 64) model of the shape
  as an mlx-lm directory that both servers load, its vocabulary and tokenizer files those of ``MLX_DIR`` (the
  SmolLM2 directory ``convert`` writes: real chat prompts, and token ids a detokenizer knows);
* ``serve --tau T [our server's flags]``: our server (``mlx_dflash2.server``'s own code, :func:`~mlx_dflash2.server.
  cli.main`) on ``--model`` with the scripted drafter; ``bench_server.py --server scripted:T`` starts it.

    python3 benchmarks/scripted_server.py make "$TMPDIR/q8b" --tokenizer "$TMPDIR/smol-q4" --shape qwen3-8b
    python3 benchmarks/bench_server.py --server scripted:3 --server ours:none --server mlx_lm \\
        --model "$TMPDIR/q8b" --mlx-model "$TMPDIR/q8b" --no-dequantize --dtype bfloat16 --concurrency 1,8,32
"""

from __future__ import annotations

import argparse
import json
import logging
import shutil
import sys
import time
from dataclasses import replace
from pathlib import Path

sys.path[:0] = [str(Path(__file__).resolve().parents[1]), str(Path(__file__).resolve().parent)]  # this checkout
import mlx_dflash2  # noqa: F401,E402  (before MLX: loads the optimized OpenBLAS)

import mlx.core as mx  # noqa: E402

from mlx_dflash2.proposers import Proposal, Proposer, ProposerSession  # noqa: E402

log = logging.getLogger("scripted_server")
#: files of a model directory that are not the tokenizer's (``make`` copies the others from ``--tokenizer``)
MODEL_FILES = ("config.json", "model.safetensors.index.json")


class OracleProposer(Proposer):
    """A scripted drafter for many requests: request ``prompt``'s proposals are ``references[tuple(prompt)]`` (its
    greedy continuation) with the first error at block offset ``tau - 1`` in every round.

    Args:
        references: prompt ids (tuple) -> generated ids (plain greedy, first one included).
        tau: tokens a full-width round emits (1..``block_size``: 1 proposes one wrong token per round).
        block_size: B.
        vocab: the target's vocabulary size (a wrong token is ``(right + 1) % vocab``).
        reference: ``prompt ids -> generated ids`` for a prompt not in ``references`` (called on the calling
            thread, the server's worker: a computed continuation stalls the batch once per new prompt, so ``serve``
            precomputes the benchmark's pool and gives the others an empty one); ``None``: such a request's rounds
            stay plain.
    """

    name = "scripted"

    def __init__(self, references: dict, tau: int, block_size: int, vocab: int, reference=None):
        if not 1 <= tau <= block_size:  # (a round emits at most B tokens)
            raise ValueError(f"--tau must be in 1..{block_size} (the block size), got {tau}")
        self.references, self.tau, self.block_size, self.vocab = references, int(tau), int(block_size), int(vocab)
        self.reference, self.misses = reference, 0

    def start(self, prompt):
        key = tuple(int(t) for t in prompt)
        return _OracleSession(self, [], key, self.continuation(key))

    def continuation(self, prompt: tuple) -> list[int] | None:
        """``prompt``'s reference (computed with ``reference`` and kept if new; ``None``: none, plain rounds)."""
        ref = self.references.get(prompt)
        if ref is None:
            self.misses += 1
            if self.reference is not None:
                ref = self.references[prompt] = list(self.reference(list(prompt)))
        return ref


class _OracleSession(ProposerSession):
    """One request's script: its committed ids (``history``) and its prompt's reference, looked up at the first
    proposal after the prompt, and again after a :meth:`truncate` (a prompt cache hands a finished request's
    session, cut back to the shared prefix, to the next request, whose prompt is the history at its first
    proposal)."""

    def __init__(self, p: OracleProposer, history: list[int], prompt: tuple | None = None,
                 reference: list[int] | None = None):
        self.p, self.history, self.prompt, self.ref = p, history, prompt, reference

    def extend(self, tokens, features):
        self.history += [int(t) for t in tokens]

    def truncate(self, n):
        del self.history[n:]
        self.prompt = self.ref = None  # the next proposal is a new request's: its prompt is the history then

    def clone(self):
        return _OracleSession(self.p, list(self.history), self.prompt, self.ref)

    def propose(self, anchor, n, temperature=0.0, key=None):
        if self.prompt is None:
            self.prompt = tuple(self.history)
            self.ref = self.p.continuation(self.prompt)
        if self.ref is None or n <= 0:
            return Proposal.empty()
        g = len(self.history) - len(self.prompt)  # the anchor's index in the generated sequence
        right = self.ref[g + 1 : g + 1 + n]
        right += [0] * (n - len(right))
        toks = [(t + 1) % self.p.vocab if i == self.p.tau - 1 else t for i, t in enumerate(right)]
        return Proposal(mx.array(toks, dtype=mx.int32), source="drafter")


def plain_references(target, prompts: list[list[int]], horizon: int, eos=()) -> list[list[int]]:
    """Every prompt's greedy continuation of ``horizon`` tokens, plain decoding in one batch (our server's
    batched rounds without a drafter, so a row of the benchmark's batches departs from it at near-ties only)."""
    from mlx_dflash2.batch import SpeculativeBatch

    batch = SpeculativeBatch(target)
    uids = [batch.add(p, horizon, eos_token_ids=list(eos)) for p in prompts]
    out = {u: [] for u in uids}
    while batch.active or batch.pending:
        for ev in batch.step():
            out[ev.uid] += ev.tokens
    return [out[u] for u in uids]


#: files of which a ``--tokenizer`` directory must hold one (a tokenizer's vocabulary)
TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json")


def make(args) -> int:
    """``make``: the random-weight model directory (see the module's docstring), written into a temporary
    directory beside ``DIR`` and renamed to it at the end (a failed or interrupted ``make`` leaves no ``DIR``).

    Raises:
        SystemExit: a ``--tokenizer`` that is not a model directory with a tokenizer, or a ``DIR`` that is not an
            empty or absent directory (``--tokenizer``'s own, say).
    """
    import tempfile

    import random_targets as rt
    from mlx_lm.utils import save_config, save_model

    src, dst = Path(args.tokenizer), Path(args.dir)
    cfg_path = src / "config.json"
    if not cfg_path.is_file():
        raise SystemExit(f"--tokenizer: {src} is not an MLX model directory (no config.json)")
    try:
        vocab = json.loads(cfg_path.read_text())["vocab_size"]
    except (ValueError, KeyError, TypeError) as e:
        raise SystemExit(f"--tokenizer: {cfg_path} has no vocab_size ({type(e).__name__}: {e})") from None
    if isinstance(vocab, bool) or not isinstance(vocab, int) or vocab < 1:
        raise SystemExit(f"--tokenizer: {cfg_path}: vocab_size must be an integer >= 1, got {vocab!r}")
    if not any((src / f).is_file() for f in TOKENIZER_FILES):
        raise SystemExit(f"--tokenizer: {src} has no tokenizer (none of {', '.join(TOKENIZER_FILES)})")
    if dst.exists() and (not dst.is_dir() or any(dst.iterdir())):
        raise SystemExit(f"{dst} exists and is not an empty directory (make writes a new one)")
    dst.parent.mkdir(parents=True, exist_ok=True)
    tic = time.perf_counter()
    model, cfg = rt.build_target(args.shape, vocab=vocab, seed=args.seed)
    tmp = Path(tempfile.mkdtemp(prefix=f".{dst.name}.", dir=dst.parent))
    try:
        save_model(tmp, model)
        save_config({**cfg, "quantization": {"group_size": 64, "bits": 4}}, tmp / "config.json")
        for f in src.iterdir():
            if f.is_file() and f.name not in MODEL_FILES and not f.name.endswith(".safetensors"):
                shutil.copy(f, tmp / f.name)
        if dst.is_dir():
            dst.rmdir()  # (empty)
        tmp.rename(dst)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    print(f"wrote {dst}: random {args.shape} (vocabulary {vocab} of {src.name}), 4-bit g64, "
          f"{rt.nbytes(model) / 1e9:.2f} GB in {time.perf_counter() - tic:.1f} s", flush=True)
    return 0


def serve_parser() -> argparse.ArgumentParser:
    """``serve``'s flags: our server's and the script's."""
    from mlx_dflash2.server import cli

    parser = cli.setup_arg_parser()
    parser.add_argument("--tau", type=cli._positive, required=True,
                        help="tokens a full-width round emits (the script; at most the block size)")
    parser.add_argument("--pool", type=cli._non_negative, default=24,
                        help="bench_server.py's prompt pool, precomputed")
    parser.add_argument("--horizon", type=cli._positive, default=256,
                        help="tokens of each precomputed continuation")
    return parser


def pool_ids(tok, args) -> list[list[int]]:
    """The prompt ids of ``bench_server.py``'s pool (``args.pool`` prompts) as our server tokenizes its chat
    requests (``--chat-template``, ``--chat-template-args``; no chat template: the plain conversation's text)."""
    from bench_server import prompts

    from mlx_dflash2.server import cli
    from mlx_dflash2.server.engine import Job, request_ids

    cli.set_chat_template(tok, args.chat_template)  # (as build_app does after the load)
    return [request_ids(tok, Job(kind="chat", max_tokens=1, messages=[{"role": "user", "content": p}]),
                        args.chat_template_args) for p in prompts(args.pool)]


def scripted_model(args):
    """``serve``'s model: ``--model`` without a drafter, with the scripted one (:class:`OracleProposer`) whose
    references of ``bench_server.py``'s pool are computed now."""
    from mlx_dflash2.loading import load

    B = args.block_size or 16
    OracleProposer({}, args.tau, B, 1)  # (its ValueError on a bad --tau before the load)
    model, tok = load(args.model, "none", dtype=args.dtype, dequantize=args.dequantize, kernels=args.kernels,
                      names="cli")
    eos = list(tok.eos_token_ids)

    def reference(ids: list[int]) -> list[int]:
        # a prompt outside the pool (the server's warm-up's scratch rows, 32 of them on a GPU): an empty reference,
        # so its drafts are wrong tokens; its rounds still meet the drafting widths' shapes (what the warm-up is
        # for) and no continuation is computed on the worker (at the 8B shape, seconds each). The table's tau shows
        # a measured prompt that missed.
        return []

    tic = time.perf_counter()
    pool = pool_ids(tok, args)
    refs = dict(zip((tuple(p) for p in pool), plain_references(model.target, pool, args.horizon, eos)))
    log.warning("scripted drafter: tau %d, block %d, %d continuations of %d tokens in %.1f s", args.tau, B,
                len(refs), args.horizon, time.perf_counter() - tic)
    oracle = OracleProposer(refs, args.tau, B, model.target.vocab_size, reference)
    return replace(model, proposer=oracle, block_size=B), tok


def serve(argv: list[str]) -> int:
    """``serve``: our server with the scripted drafter (``--tau``); the other flags are the server's."""
    from mlx_dflash2.server import cli

    return cli.main(argv, parser=serve_parser(), make_model=scripted_model)


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["serve"]:
        return serve(argv[1:])
    import random_targets as rt

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    mk = sub.add_parser("make", help="write the random-weight model directory")
    mk.add_argument("dir")
    mk.add_argument("--tokenizer", required=True, help="an MLX model directory whose tokenizer and vocabulary to use")
    mk.add_argument("--shape", default="qwen3-8b", choices=list(rt.SHAPES),
                    help="a random_targets.SHAPES name (tiny: a CPU check)")
    mk.add_argument("--seed", type=int, default=0)
    sub.add_parser("serve", help="our server with the scripted drafter: serve --tau T [server flags]")
    args = ap.parse_args(argv)
    return make(args)


if __name__ == "__main__":
    sys.exit(main())
