"""The ``mlx_dflash2.server`` command (also ``python -m mlx_dflash2.server``).

A drop-in for ``mlx_lm.server`` with DFlash2 speculative decoding behind it:
same flag names where they exist, OpenAI-compatible endpoints, FastAPI on
uvicorn.
"""

from __future__ import annotations

import argparse
import errno
import json
import logging
import os
import re
import socket
import sys
from pathlib import Path

from ..kernels.registry import CUDA_GRAPHS_VAR, cuda_graphs_on
from ..loading import (ADAPTIVE_HELP, CALIBRATE_HELP, DRAFT_CONFIDENCE_HELP, DRAFT_VOCAB_HELP, DRAFTER_HELP,
                       DRAFTER_WINDOW_HELP, KERNELS_HELP, draft_confidence_arg, drafter_window_arg)

__all__ = ["main", "setup_arg_parser", "build_app", "check_listen", "set_chat_template", "cuda_graphs_setting",
           "cuda_graphs_on"]


def _size(text: str) -> int:
    """``"512MB"``, ``"2G"``, ``"1000000"`` -> bytes."""
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([kmgt]?)i?b?\s*", text.lower())
    if not m:
        raise argparse.ArgumentTypeError(f"not a size: {text!r} (e.g. 512MB, 2GB)")
    return int(float(m.group(1)) * 1024 ** " kmgt".index(m.group(2) or " "))


def _positive(text: str) -> int:
    v = int(text)
    if v < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {v}")
    return v


def _non_negative(text: str) -> int:
    v = int(text)
    if v < 0:
        raise argparse.ArgumentTypeError(f"must be >= 0, got {v}")
    return v


def _positive_seconds(text: str) -> float:
    try:
        v = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a number of seconds > 0, got {text!r}") from None
    if not v > 0 or v == float("inf"):
        raise argparse.ArgumentTypeError(f"must be a number of seconds > 0, got {text}")
    return v


def _switch_interval(text: str) -> float:
    """``--switch-interval``: seconds within what ``sys.setswitchinterval`` keeps (it holds whole microseconds:
    below 1e-6 s, or past ~1.8e13 s where the conversion overflows, it silently runs at 1 microsecond; the
    breaker helper of session 48). Bounded at 1 s: a longer interval only lets a thread hold the GIL longer."""
    v = _positive_seconds(text)
    if not 1e-6 <= v <= 1.0:
        raise argparse.ArgumentTypeError(f"must be between 1e-06 and 1 second, got {text}")
    return v


def check_args(args: argparse.Namespace) -> None:
    """What argparse cannot check alone, before anything loads (a fresh user's finds, session 24: ``--temp -1``
    started a server that answered every request without ``temperature`` with a 400 blaming the client, and
    ``--chat-template`` with a missing file served the path itself as the template).

    Raises:
        ValueError: bad default sampling settings, or a ``--chat-template`` that is neither a Jinja template
            (it holds ``{``) nor an existing file.
    """
    from ..sampling import SamplingParams

    try:
        SamplingParams(temp=args.temp, top_p=args.top_p, top_k=args.top_k, min_p=args.min_p).validate()
    except ValueError as e:  # "top_p: must be ..." -> "--top-p: must be ..."
        name, _, why = str(e).partition(":")
        raise ValueError(f"--{name.replace('_', '-')}:{why}") from None
    t = args.chat_template
    if t and "{" not in t and not Path(t).is_file():
        raise ValueError(f"--chat-template: no such file: {t} "
                         "(a template given inline is Jinja text, with {% or {{)")


def cuda_graphs_setting(args: argparse.Namespace, environ=None) -> str | None:
    """What ``--cuda-graphs`` makes of MLX's ``MLX_USE_CUDA_GRAPHS`` for this server: ``"1"``, ``"0"`` or ``None``
    (leave the environment as it is).

    ``on`` / ``off`` set it whatever the environment says. ``auto`` (the default) leaves a value the user set, and
    otherwise turns CUDA graphs off for a server that batches drafting rows (a drafter or lookup, block size above
    1, ``--max-batch`` and ``--decode-concurrency`` of 2 or more). Why (issue 22, session 52, an H100, SmolLM2 with
    the shipped drafter, 8 clients): MLX caches one graph executable per distinct sequence of kernels, and a
    drafting batch's rounds (rows x widths x the drafter's context) keep making new ones, so its rounds paid for
    instantiating graphs: drafting rounds 45-82 ms and even its plain rounds 15 ms against 8.5 ms in a server
    without a drafter, 378 against 648 tok/s (``benchmarks/engine_load.py``); with graphs off the same rounds took
    14 and 8.8 ms and the drafter's server ran 745 tok/s, and over HTTP 600 against 443 tok/s at 8 clients
    (``bench_server.py``). A server without drafting, or one that serves requests one at a time (``--max-batch`` 0
    or 1, ``--decode-concurrency`` 1: the solo loop's few shapes), keeps MLX's default (graphs on: 170 against
    136-157 tok/s for one client). The trade depends on the host: on session 53's slower H100 host the SmolLM2
    drafter did not pay from 5 rows and the drafter's server ran plain rounds without graphs, 16.3 against 14.3 ms
    a step in the plain server with them (0.97x ``mlx_lm.server`` at 8 clients); ``on`` keeps them.

    Args:
        args: the parsed flags (``cuda_graphs``, ``drafter``, ``block_size``, ``max_batch``, ``decode_concurrency``).
        environ: the environment to read (default ``os.environ``).
    """
    environ = os.environ if environ is None else environ
    mode = getattr(args, "cuda_graphs", "auto")
    if mode in ("on", "off"):
        return "1" if mode == "on" else "0"
    if CUDA_GRAPHS_VAR in environ:
        return None
    drafting = args.drafter != "none" and args.block_size != 1  # (the loader's keyword, exactly)
    batched = min(args.max_batch, args.decode_concurrency) >= 2  # (the engine admits decode_concurrency at most)
    return "0" if drafting and batched else None


def listen_host(text: str) -> str:
    """``--host`` as given, an IPv6 address written as in a URL (``[::1]``) without its brackets (the start-up line
    prints ``http://[::1]:PORT``; a fresh user's find: ``--host [::1]`` was refused as not resolving)."""
    t = text.strip()
    return t[1:-1] if len(t) > 2 and t[0] == "[" and t[-1] == "]" else text


def check_listen(host: str, port: int) -> None:
    """Bind (then close) a socket on every address of ``host`` at ``port``, as uvicorn's listening socket will be
    made (asyncio's ``create_server``: address reuse, IPv6 sockets IPv6-only): what would fail there fails here,
    before the model loads (a fresh user's find, session 25: ``--host 999.1.1.1`` loaded the model, logged
    "serving ..." and only then failed to bind).

    Raises:
        ValueError: ``host`` is empty, does not resolve or is not an address of this machine; ``port`` is in use
            or not allowed.
    """
    if not host.strip():  # getaddrinfo would take "" as every interface: an unset $HOST must not expose the server
        raise ValueError("--host is empty: give an address (127.0.0.1 for this machine only, 0.0.0.0 for every "
                         "interface)")
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except socket.gaierror as e:
        raise ValueError(f"--host {host}: not an IP address or a host name that resolves ({e.strerror})") from None
    for family, kind, proto, _, addr in infos:
        with socket.socket(family, kind, proto) as sock:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            if family == socket.AF_INET6 and hasattr(socket, "IPPROTO_IPV6"):
                sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
            try:
                sock.bind(addr)
            except OSError as e:
                if e.errno == errno.EADDRINUSE:
                    why = f"--port {port}: already in use on {addr[0]} (another server? pick another --port)"
                elif e.errno == errno.EADDRNOTAVAIL:
                    why = f"--host {host}: not an address of this machine ({e.strerror})"
                else:
                    why = f"cannot listen on {addr[0]} port {port}: {e.strerror or e}"
                raise ValueError(why) from None


def tcp_port(text: str) -> int:
    """``--port``'s argparse type (its name is in argparse's "invalid tcp_port value" message): an int in 0..65535."""
    v = int(text)
    if not 0 <= v <= 65535:
        raise argparse.ArgumentTypeError(f"a TCP port is 0..65535, got {v}")
    return v


def _json_object(text: str) -> dict:
    try:
        v = json.loads(text)
    except json.JSONDecodeError as e:
        raise argparse.ArgumentTypeError(f"not valid JSON: {e}") from None
    if not isinstance(v, dict):
        raise argparse.ArgumentTypeError("must be a JSON object")
    return v


def setup_arg_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="mlx_dflash2.server",
        description="OpenAI-compatible HTTP server with lossless DFlash2 speculative decoding "
        "(a drop-in for mlx_lm.server).",
    )
    p.add_argument("--model", default=None, help="target: a GGUF file, an mlx-lm directory or hub id "
                   "(default: the embedded SmolLM2-135M-Instruct)")
    p.add_argument("--drafter", "--draft-model", default="auto", help=DRAFTER_HELP)
    p.add_argument("--no-lookup", action="store_true", help="do not fuse lookup proposals with the drafter's")
    p.add_argument("--no-trees", action="store_true",
                   help="greedy requests served alone (a batch's only row, or --max-batch 0) verify the drafter's "
                        "chain only, not a tree of its candidates (same output; rows of a batch of several always "
                        "verify chains)")
    p.add_argument("--draft-confidence", type=draft_confidence_arg, default=None, metavar="C",
                   help=DRAFT_CONFIDENCE_HELP)
    p.add_argument("--drafter-window", type=drafter_window_arg, default=None, metavar="N",
                   help=DRAFTER_WINDOW_HELP)
    p.add_argument("--draft-vocab", choices=["auto", "full"], default=None, help=DRAFT_VOCAB_HELP)
    p.add_argument("--adaptive", action=argparse.BooleanOptionalAction, default=None, help=ADAPTIVE_HELP)
    p.add_argument("--calibrate", action=argparse.BooleanOptionalAction, default=None, help=CALIBRATE_HELP)
    p.add_argument("--block-size", "--num-draft-tokens", type=_positive, default=None,
                   help="block size B (verify width; 1 = no drafting); default the drafter's")
    p.add_argument("--host", type=listen_host, default="127.0.0.1",
                   help="host to listen on (default: 127.0.0.1; an IPv6 address with or without brackets: ::1, [::1])")
    p.add_argument("--port", type=tcp_port, default=8080, help="port, 0..65535 (default: 8080)")
    p.add_argument("--allowed-origins", type=lambda x: x.split(","), default=["*"],
                   help="comma-separated CORS origins (default: *)")
    p.add_argument("--temp", type=float, default=0.0, help="default sampling temperature (0 = greedy)")
    p.add_argument("--top-p", type=float, default=1.0, help="default nucleus sampling top-p")
    p.add_argument("--top-k", type=int, default=0, help="default top-k (0 = off)")
    p.add_argument("--min-p", type=float, default=0.0, help="default min-p (0 = off)")
    p.add_argument("--max-tokens", type=_positive, default=512, help="default max_tokens (default: 512)")
    p.add_argument("--chat-template", default="", help="chat template (Jinja string or file) replacing the model's")
    p.add_argument("--chat-template-args", type=_json_object, default={},
                   help='JSON of default chat template arguments, e.g. \'{"enable_thinking": false}\'')
    p.add_argument("--prompt-cache-size", type=_non_negative, default=10,
                   help="prompt (prefix) states kept across requests (0 = no prompt cache; default 10)")
    p.add_argument("--prompt-cache-bytes", type=_size, default=None,
                   help="byte limit of the prompt cache, e.g. 4GB (default: no byte limit)")
    p.add_argument("--max-context", type=_positive, default=None,
                   help="limit on prompt + generated tokens per request (default: the target's context)")
    p.add_argument("--decode-concurrency", type=_positive, default=32,
                   help="requests generated at once; more wait in order (default 32)")
    p.add_argument("--max-batch", type=_non_negative, default=32,
                   help="requests (greedy or sampled, any logprobs / penalties / logit bias; every target family) "
                   "advanced together by one batched round (one target forward) at most; more wait in order; "
                   "0 = no batching: every request gets its own rounds, round-robin (default 32, as mlx_lm.server's "
                   "--decode-concurrency)")
    p.add_argument("--batch-schedule", choices=["auto", "full"], default="auto",
                   help="verify widths of batched rounds: auto = each round's width capped by measured "
                   "throughput (never much slower than plain batched decoding); full = every request verifies "
                   "its whole draft (default auto)")
    p.add_argument("--warmup", action=argparse.BooleanOptionalAction, default=None,
                   help="run the batched rounds' shapes (2 .. --max-batch rows, verify widths up to the block "
                   "size) once at start, so that the GPU backend builds its kernels for them before serving "
                   "(default: on a GPU backend; a CUDA machine's first start compiles for a minute or more)")
    p.add_argument("--cuda-graphs", choices=["auto", "on", "off"], default="auto",
                   help="MLX's CUDA graphs (MLX_USE_CUDA_GRAPHS; nothing on a Mac): auto = your "
                   "MLX_USE_CUDA_GRAPHS if set, else off for a server that batches drafting requests (their rounds' "
                   "changing shapes rebuild graphs: 1.35x more tokens/s at 8 clients on one H100 without them; on "
                   "a slower host, where the drafter did not pay, it slowed the plain rounds ~14%%), else MLX's "
                   "default (on); on / off: set it (default auto)")
    p.add_argument("--switch-interval", type=_switch_interval, default=None, metavar="SECONDS",
                   help="the interpreter's thread switch interval (sys.setswitchinterval) while serving: how long "
                   "the generation worker may run Python (building a round's graph) before the HTTP thread may "
                   "take the GIL from it (1e-06 to 1; default: Python's, 0.005)")
    p.add_argument("--prefill-step-size", type=_positive, default=2048, help="prompt chunk size (tokens)")
    p.add_argument("--keepalive-interval", type=_positive_seconds, default=5.0,
                   help="seconds of silence before an SSE ': keep-alive' comment (default 5)")
    p.add_argument("--dtype", choices=["auto", "float32", "float16", "bfloat16"], default="auto",
                   help="dtype of non-packed weights/scales (auto: float32 on CPU)")
    p.add_argument("--dequantize", action=argparse.BooleanOptionalAction, default=None,
                   help="expand quantized weights (target and drafter) to dense --dtype (default: only on "
                   "the CPU backend for a target whose dense weights fit in 40%% of the memory, where quantized "
                   "matmuls are slow)")
    p.add_argument("--kernels", choices=["auto", "reference", "kernel"], default=None, help=KERNELS_HELP)
    p.add_argument("--log-level", default="INFO", choices=["DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL"],
                   help="logging level (default: INFO)")
    return p


def set_chat_template(tokenizer, template: str) -> None:
    """``--chat-template``: ``template`` (a Jinja string, or a file holding one) replaces ``tokenizer``'s own;
    ``""`` keeps it."""
    if template:
        if "{" not in template and Path(template).is_file():
            template = Path(template).read_text()
        tokenizer.chat_template = template
        tokenizer.has_chat_template = True


def build_app(args: argparse.Namespace, model=None, tokenizer=None):
    """Load the model (unless given) and build the FastAPI app for parsed ``args``.

    Returns:
        ``(app, engine)``.

    Raises:
        FileNotFoundError, ValueError: the model or drafter cannot be loaded; :func:`check_args`'s errors
            (before loading).
    """
    from ..loading import load
    from .app import ServerSettings, create_app
    from .engine import Engine, EngineConfig

    check_args(args)
    if model is None:
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
    set_chat_template(tokenizer, args.chat_template)
    engine = Engine(
        model,
        tokenizer,
        EngineConfig(
            block_size=args.block_size,
            max_context=args.max_context,
            prompt_cache_size=args.prompt_cache_size,
            prompt_cache_bytes=args.prompt_cache_bytes,
            decode_concurrency=args.decode_concurrency,
            max_batch=args.max_batch,
            batch_schedule=args.batch_schedule,
            warmup=args.warmup,
            prefill_step_size=args.prefill_step_size,
            chat_template_args=args.chat_template_args,
        ),
    )
    settings = ServerSettings(
        model_id=model.name,
        temp=args.temp,
        top_p=args.top_p,
        top_k=args.top_k,
        min_p=args.min_p,
        max_tokens=args.max_tokens,
        keepalive_s=args.keepalive_interval,
        allowed_origins=args.allowed_origins,
        model_aliases=("default_model", args.model) if args.model else ("default_model",),
    )
    return create_app(engine, settings), engine


def main(argv=None, *, parser: argparse.ArgumentParser | None = None, make_model=None) -> int:
    """Parse flags, load the model and serve until interrupted.

    Args:
        argv: the flags (default ``sys.argv[1:]``).
        parser: the flags' parser (default :func:`setup_arg_parser`'s; a benchmark's may add flags of its own).
        make_model: ``args -> (model, tokenizer)`` building the model instead of loading ``--model`` and
            ``--drafter`` (``benchmarks/scripted_server.py``: a random-weight target with a scripted drafter);
            its ``FileNotFoundError`` and ``ValueError`` are reported as the loader's are.

    Returns:
        The exit status: 0 after a clean stop, 2 for a model that cannot be loaded, 130 for a Ctrl-C while loading.
    """
    args = (parser or setup_arg_parser()).parse_args(argv)
    logging.basicConfig(level=getattr(logging, args.log_level), format="%(asctime)s - %(levelname)s - %(message)s")
    graphs = cuda_graphs_setting(args)
    if graphs is not None:  # before any GPU work: MLX reads it once, at its first
        os.environ[CUDA_GRAPHS_VAR] = graphs
    import uvicorn

    try:
        check_listen(args.host, args.port)  # before the (slow) load, and before "serving ..." is logged
        app, engine = build_app(args) if make_model is None else build_app(args, *make_model(args))
    except (FileNotFoundError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:  # Ctrl-C while the model loads: one line, not a traceback from inside a loader
        print("interrupted while loading the model", file=sys.stderr)
        return 130
    p = engine.model.proposer

    from ..kernels import backend

    def serving(url: str) -> None:  # once listening: the port bound (--port 0 asks for any), an IPv6 host in [...]
        logging.getLogger("mlx_dflash2.server").info(
            "serving %s (drafter %s, block size %d%s) on %s/v1",
            engine.model.name, p.name if p else "none", args.block_size or engine.model.block_size,
            f", CUDA graphs {'on' if cuda_graphs_on() else 'off'}" if backend() == "cuda" else "", url,
        )

    from .app import AppServer

    if args.switch_interval is not None:
        sys.setswitchinterval(args.switch_interval)
    try:
        AppServer(uvicorn.Config(app, host=args.host, port=args.port, log_level=args.log_level.lower()),
                  on_started=serving).run()
    except KeyboardInterrupt:  # uvicorn re-raises the Ctrl-C it caught once its shutdown is done (as uvicorn.run,
        pass  # which swallows it): the server has stopped cleanly, no traceback
    return 0
