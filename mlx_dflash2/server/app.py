"""The FastAPI application: OpenAI-compatible endpoints over the :class:`~.engine.Engine`.

Endpoints: ``POST /v1/chat/completions``, ``POST /v1/completions``,
``GET /v1/models``, ``GET /health``, ``GET /metrics``, and the OpenAPI schema
(``GET /openapi.json``, ``GET /docs``). Handlers are async: they validate the
request (pydantic, :mod:`.protocol`), hand a :class:`~.engine.Job` to the
generation worker and turn its events into OpenAI responses, streamed as
server-sent events when ``stream`` is true. Every error is a JSON body in
OpenAI's format; bad requests get 400 with ``param`` naming the field, an unknown
``model`` 404 with code ``model_not_found`` (as OpenAI answers).
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
import uuid
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Callable, Literal, Optional

import uvicorn
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.middleware.cors import CORSMiddleware
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from .._version import __version__
from .engine import BATCH_STEP_KINDS, WORKER_PARTS, Admitted, Engine, Failed, Job, Progress, TokenOut
from .protocol import (
    FIELD_NAMES,
    APIError,
    ChatCompletionRequest,
    ChatCompletionResponse,
    CompletionRequest,
    CompletionResponse,
    ErrorResponse,
    Health,
    ModelList,
    bad_request,
    invalid_value,
)
from .text import ReasoningSplitter

__all__ = ["create_app", "ServerSettings"]

log = logging.getLogger("mlx_dflash2.server")


@dataclass
class ServerSettings:
    """Request defaults and HTTP settings (the CLI flags).

    Attributes:
        model_id: the id the served model is listed under (``GET /v1/models``).
        temp, top_p, top_k, min_p: default sampling parameters.
        max_tokens: default ``max_tokens``.
        keepalive_s: seconds of silence after which a stream gets a ``: keep-alive`` comment.
        allowed_origins: CORS origins (``["*"]``: any).
        model_aliases: other names accepted in the ``model`` field.
    """

    model_id: str = "default_model"
    temp: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    max_tokens: int = 512
    keepalive_s: float = 5.0
    allowed_origins: list = field(default_factory=lambda: ["*"])
    model_aliases: tuple = ("default_model",)


_ERRORS = {400: {"model": ErrorResponse, "description": "invalid request (OpenAI invalid_request_error)"},
           404: {"model": ErrorResponse,
                 "description": "unknown model (OpenAI invalid_request_error, code model_not_found)"}}


def model_not_found(name: str, served: str) -> APIError:
    """OpenAI's answer to an unknown model: 404, ``invalid_request_error``, code ``model_not_found``."""
    return APIError(404, f"The model '{name}' does not exist; this server serves '{served}'.", "model",
                    "model_not_found", type="invalid_request_error")


def _param_from_loc(loc) -> Optional[str]:
    """``('body', 'messages', 0, 'role')`` -> ``'messages[0].role'`` (type tags of unions dropped); a query
    parameter's loc ``('query', 'format')`` -> ``'format'``."""
    if len(loc) >= 2 and loc[0] == "query":  # e.g. GET /metrics?format=JSON: it was blamed on a missing body
        return str(loc[1])
    parts: list[str] = []
    for p in list(loc)[1:] if loc and loc[0] == "body" else list(loc):
        if isinstance(p, int):
            if not parts:
                break
            parts[-1] += f"[{p}]"
        elif p in FIELD_NAMES and not (parts and parts[-1].split("[")[0] in ("logit_bias", "chat_template_kwargs")):
            parts.append(p)
        else:
            break
    return ".".join(parts) or None


def _validation_error(exc: RequestValidationError) -> APIError:
    errors = exc.errors()
    if not errors:
        return bad_request("invalid request")
    e = errors[0]
    kind = e.get("type", "")
    if kind == "json_invalid":
        return bad_request(f"the request body is not valid JSON: {e.get('ctx', {}).get('error', e.get('msg'))}")
    param = _param_from_loc(e.get("loc", ()))
    msg = e.get("msg", "invalid value")
    if msg.startswith("Value error, "):  # pydantic's prefix for validator errors
        msg = msg[len("Value error, "):]
    if kind == "missing":
        return bad_request(f"Missing required parameter: '{param}'" if param else "the request body is missing",
                           param)
    if param is None:
        if kind in ("model_attributes_type", "dict_type", "model_type"):
            return bad_request("the request body must be a JSON object")
        return bad_request(msg)
    return invalid_value(param, msg)


def http_url(host: str, port: int) -> str:
    """The URL of ``host`` and ``port``: ``http://127.0.0.1:8080``, an IPv6 address in brackets
    (``http://[::1]:8080``; without them the URL is not valid)."""
    return f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"


class AppServer(uvicorn.Server):
    """uvicorn's server for an app of :func:`create_app`, with a clean force quit.

    The first Ctrl-C is uvicorn's graceful shutdown (requests in flight finish). On the second, uvicorn
    force-quits by cancelling the request handlers mid-response: a stream cut without ``[DONE]``, a
    waiting request answered with a plain-text 500, CancelledError tracebacks in the log. Here every
    request still in flight is first ended with a 503 ``server_shutdown`` error
    (:meth:`~.engine.Engine.abort_all`: a stream gets an error event and ``[DONE]``, a plain request a
    JSON body) and its handler is given up to ``drain_s`` seconds to send it; then the app's lifespan
    shutdown runs (the engine stops), which uvicorn skips on a force quit.

    Once it listens, ``on_started`` (if given) is called with its URL (:meth:`url`: the port it bound, which for
    ``--port 0`` is not the one asked for).

    Args:
        config: a ``uvicorn.Config`` whose app was made by :func:`create_app`.
        drain_s: seconds to wait for the handlers after a force quit.
        on_started: called with :meth:`url` once the server listens and the app has started.
    """

    def __init__(self, config: "uvicorn.Config", drain_s: float = 3.0,
                 on_started: Optional[Callable[[str], None]] = None):
        super().__init__(config)
        self.drain_s = drain_s
        self.on_started = on_started

    def url(self) -> str:
        """``http://HOST:PORT`` of the listening server: the host asked for (``config.host``; the socket's own
        address without one) and the port bound (the first listening socket's)."""
        socks = [sock for server in getattr(self, "servers", []) for sock in (server.sockets or ())]
        if not socks:
            raise RuntimeError("the server is not listening")
        addr, port = socks[0].getsockname()[:2]
        return http_url(self.config.host or addr, port)

    async def startup(self, sockets=None) -> None:
        await super().startup(sockets=sockets)
        if self.started and self.on_started is not None:  # not started: it failed to bind, or the app to start
            self.on_started(self.url())

    def handle_exit(self, sig, frame) -> None:
        """uvicorn's Ctrl-C handler; before the server has started (the engine's start-up warm-up runs in the app's
        startup), it also asks the engine to stop, so the warm-up ends at its next batch shape instead of running on."""
        super().handle_exit(sig, frame)
        if not self.started:
            self.config.app.state.engine.stop(timeout=0)

    async def shutdown(self, sockets=None) -> None:
        await super().shutdown(sockets=sockets)
        if self.force_exit:  # uvicorn skipped waiting for the requests in flight: end them with an error
            state = self.config.app.state
            state.engine.abort_all()
            await state.handlers_done(self.drain_s)
            lifespan = getattr(self, "lifespan", None)  # uvicorn skips the app's shutdown on a force quit: its
            if lifespan is not None:                    # task would be cancelled with a traceback in the log
                await lifespan.shutdown()


def create_app(engine: Engine, settings: Optional[ServerSettings] = None) -> FastAPI:
    """Build the FastAPI app serving ``engine`` (started/stopped with the app).

    Args:
        engine: the generation :class:`~.engine.Engine` (owns the model).
        settings: :class:`ServerSettings` (defaults if None).

    Returns:
        The ASGI application (run it with uvicorn).
    """
    settings = settings or ServerSettings()
    tokenizer = engine.tokenizer
    fingerprint = f"mlx_dflash2-{__version__}"
    created = int(time.time())

    @asynccontextmanager
    async def lifespan(app):
        engine.start()
        try:
            yield
        finally:
            engine.stop()

    app = FastAPI(
        title="mlx_dflash2 server",
        version=__version__,
        description="OpenAI-compatible server with lossless DFlash2 speculative decoding (mlx_lm.server style).",
        lifespan=lifespan,
    )
    app.state.engine = engine
    app.state.settings = settings
    busy = [0]  # request handlers and streams running (AppServer waits for them on a force quit)

    async def handlers_done(timeout: float) -> bool:
        end = time.monotonic() + timeout
        while busy[0] and time.monotonic() < end:
            await asyncio.sleep(0.02)
        return not busy[0]

    app.state.handlers_done = handlers_done
    app.add_middleware(
        CORSMiddleware, allow_origins=list(settings.allowed_origins), allow_methods=["*"], allow_headers=["*"]
    )

    def error_response(err: APIError, count: bool = True) -> JSONResponse:
        if count:  # errors reported by the worker are counted there
            engine.metrics.add(errors=1)
        return JSONResponse(err.body(), status_code=err.status)

    @app.exception_handler(APIError)
    async def _api_error(request: Request, exc: APIError):
        return error_response(exc)

    @app.exception_handler(RequestValidationError)
    async def _invalid(request: Request, exc: RequestValidationError):
        err = _validation_error(exc)
        ctype = request.headers.get("content-type", "")
        if err.param is None and "json" not in ctype.lower():  # the body was not parsed as JSON at all
            err = bad_request(f"the request body must be a JSON object sent with 'Content-Type: application/json' "
                              f"(got {ctype or 'no Content-Type'!r})")
        return error_response(err)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException):
        return error_response(APIError(exc.status_code, str(exc.detail)))

    @app.exception_handler(Exception)
    async def _unexpected(request: Request, exc: Exception):
        log.exception("unexpected error")
        return error_response(APIError(500, f"internal error: {type(exc).__name__}"))

    # ---- request -> job ----------------------------------------------------

    def check_model(name: Optional[str]) -> None:
        if name is not None and name != settings.model_id and name not in settings.model_aliases:
            raise model_not_found(name, settings.model_id)

    def gen_kwargs(body) -> dict:
        pick = lambda v, d: d if v is None else v  # noqa: E731 - null means the default
        top_k = pick(body.top_k, settings.top_k)
        if top_k > engine.vocab_size:
            raise invalid_value("top_k", f"must be at most the vocabulary size ({engine.vocab_size}), got {top_k}")
        bias = None
        if body.logit_bias:
            bias = {int(k): float(v) for k, v in body.logit_bias.items()}
            if any(k >= engine.vocab_size for k in bias):
                raise invalid_value("logit_bias", f"token ids must be below {engine.vocab_size}, got {max(bias)}")
        return dict(
            temp=pick(body.temperature, settings.temp),
            top_p=pick(body.top_p, settings.top_p),
            top_k=top_k,
            min_p=pick(body.min_p, settings.min_p),
            repetition_penalty=body.repetition_penalty,
            repetition_context_size=pick(body.repetition_context_size, 20),
            presence_penalty=body.presence_penalty,
            presence_context_size=pick(body.presence_context_size, 20),
            frequency_penalty=body.frequency_penalty,
            frequency_context_size=pick(body.frequency_context_size, 20),
            logit_bias=bias,
            seed=body.seed,
            stop=body.stop_list(),
        )

    def chat_messages(body: ChatCompletionRequest) -> list[dict]:
        out = []
        for m in body.messages:
            content = m.content
            if isinstance(content, list):
                content = "".join(p.text for p in content)
            d = {"role": "system" if m.role == "developer" else m.role, "content": content or ""}
            if m.name is not None:
                d["name"] = m.name
            if m.tool_calls:
                d["tool_calls"] = m.tool_calls
            if m.tool_call_id is not None:
                d["tool_call_id"] = m.tool_call_id
            out.append(d)
        return out

    # ---- job -> response ---------------------------------------------------

    class Assembler:
        """Turns token events into OpenAI text, reasoning and log-probabilities."""

        def __init__(self, chat: bool, top_n: int):
            self.chat = chat
            self.top_n = top_n
            self.splitter = ReasoningSplitter()
            self.offset = 0
            self.reasoning_tokens = 0  # emitted tokens of thinking blocks (usage.completion_tokens_details)

        def admitted(self, ev: Admitted) -> None:
            if self.chat and getattr(tokenizer, "has_thinking", False):
                self.splitter = ReasoningSplitter(tokenizer.think_start, tokenizer.think_end, ev.reasoning)

        def segments(self, ev: TokenOut) -> list[tuple[str, str]]:
            """The text of one token event (called once per event: it also counts reasoning tokens)."""
            if not self.chat:
                return [("content", ev.text)] if ev.text else []
            segs, reasoning = self.splitter.feed_token(ev.text)
            self.reasoning_tokens += reasoning
            if ev.finish_reason is not None:
                segs += self.splitter.flush()
            return segs

        def logprob_entry(self, ev: TokenOut, text_before: int):
            """Chat: an entry of ``logprobs.content``; text: (token, logprob, top dict, offset)."""
            if ev.logprob is None:
                return None
            tt = engine.token_text
            if self.chat:
                b = tt.bytes(ev.token)
                return {
                    "token": b.decode("utf-8", errors="replace"),
                    "logprob": ev.logprob,
                    "bytes": list(b),
                    "top_logprobs": [
                        {"token": tt.text(i), "logprob": lp, "bytes": list(tt.bytes(i))} for i, lp in (ev.top or [])
                    ][: self.top_n],
                }
            top = {}
            for i, lp in ev.top or []:
                top.setdefault(tt.text(i), lp)
            return (tt.text(ev.token), ev.logprob, top, text_before)

    def text_logprobs(entries: list) -> dict:
        return {
            "tokens": [e[0] for e in entries],
            "token_logprobs": [e[1] for e in entries],
            "top_logprobs": [e[2] for e in entries],
            "text_offset": [e[3] for e in entries],
        }

    def usage_dict(u: dict, asm: Assembler) -> dict:
        return {
            "prompt_tokens": u["prompt_tokens"],
            "completion_tokens": u["completion_tokens"],
            "total_tokens": u["prompt_tokens"] + u["completion_tokens"],
            "prompt_tokens_details": {"cached_tokens": u["cached_tokens"]},
            # the emitted tokens of thinking blocks (a part of completion_tokens), OpenAI's field
            "completion_tokens_details": {"reasoning_tokens": min(asm.reasoning_tokens, u["completion_tokens"])},
        }

    def spec_dict(s: dict) -> dict:
        return {
            "drafter": s["drafter"],
            "block_size": s["block_size"],
            "draft_confidence": s.get("draft_confidence", 0.0),
            "draft_vocab": s.get("draft_vocab", 0),
            "acceptance_length": round(s["tau"], 4),
            "rounds": s["rounds"],
            "rounds_by_source": dict(s.get("rounds_by_source") or {}),
            "drafted_tokens": s["drafted"],
            "accepted_tokens": s["accepted"],
            "acceptance_rate": round(s["acceptance_rate"], 4),
            "prefill_tokens_per_second": round(s["prefill_tps"], 2),
            "decode_tokens_per_second": round(s["decode_tps"], 2),
        }

    async def run(request: Request, job: Job, stream: bool, include_usage: bool, top_n: int):
        chat = job.kind == "chat"
        rid = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}"
        now = int(time.time())
        model_name = settings.model_id
        loop = asyncio.get_running_loop()
        job.loop, job.queue = loop, asyncio.Queue()
        busy[0] += 1
        engine.submit(job)
        asm = Assembler(chat, top_n)
        done = False

        async def next_event(timeout: float):
            try:
                return await asyncio.wait_for(job.queue.get(), timeout)
            except asyncio.TimeoutError:
                return None

        try:
            # Wait for the request to start (or fail) so that errors get a proper status code.
            first = None
            waited = 0.0
            while first is None:
                ev = await next_event(0.25)
                if ev is None:
                    waited += 0.25
                    if await request.is_disconnected():
                        job.cancel()
                        return Response(status_code=499)
                    if stream and waited >= settings.keepalive_s:
                        break  # a long queue or prefill: open the stream, keep-alives follow
                    continue
                if isinstance(ev, Admitted):
                    asm.admitted(ev)
                    continue
                first = ev
            if isinstance(first, Failed):
                done = True
                return error_response(first.error, count=False)

            if stream:
                response = StreamingResponse(
                    sse(job, asm, first, rid, now, model_name, chat, include_usage),
                    media_type="text/event-stream",
                    headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
                )
                done = True  # the stream owns the job from here
                return response

            content, reasoning, entries = [], [], []
            ev = first
            while True:
                if ev is None:
                    if await request.is_disconnected():
                        job.cancel()
                        return Response(status_code=499)
                elif isinstance(ev, Failed):
                    done = True
                    return error_response(ev.error, count=False)
                elif isinstance(ev, TokenOut):
                    e = asm.logprob_entry(ev, sum(map(len, content)))
                    if e is not None:
                        entries.append(e)
                    for kind, t in asm.segments(ev):
                        (reasoning if kind == "reasoning" else content).append(t)
                    if ev.finish_reason is not None:
                        done = True
                        break
                ev = await next_event(1.0)
            text = "".join(content)
            if chat:
                message = {"role": "assistant", "content": text}
                if reasoning:
                    message["reasoning_content"] = "".join(reasoning)
                choice = {"index": 0, "message": message,
                          "logprobs": {"content": entries} if top_n >= 0 else None,
                          "finish_reason": ev.finish_reason}
            else:
                choice = {"index": 0, "text": text, "logprobs": text_logprobs(entries) if top_n >= 0 else None,
                          "finish_reason": ev.finish_reason}
            return JSONResponse({
                "id": rid,
                "object": "chat.completion" if chat else "text_completion",
                "created": now,
                "model": model_name,
                "system_fingerprint": fingerprint,
                "choices": [choice],
                "usage": usage_dict(ev.usage, asm),
                "speculative": spec_dict(ev.stats),
            })
        finally:
            busy[0] -= 1
            if not done:
                job.cancel()

    async def sse(job: Job, asm: Assembler, first, rid, now, model_name, chat, include_usage):
        obj = "chat.completion.chunk" if chat else "text_completion"
        finished = False
        busy[0] += 1

        def chunk(choice: Optional[dict], **extra) -> str:
            body = {"id": rid, "object": obj, "created": now, "model": model_name,
                    "system_fingerprint": fingerprint, "choices": [choice] if choice is not None else []}
            body.update(extra)
            return f"data: {json.dumps(body, ensure_ascii=False)}\n\n"

        try:
            if chat:
                yield chunk({"index": 0, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                             "finish_reason": None})
            pending = [first] if first is not None else []
            text_len = 0
            while True:
                if pending:
                    ev = pending.pop(0)
                else:
                    try:
                        ev = await asyncio.wait_for(job.queue.get(), settings.keepalive_s)
                    except asyncio.TimeoutError:
                        yield ": keep-alive\n\n"
                        continue
                if isinstance(ev, Admitted):
                    asm.admitted(ev)
                    continue
                if isinstance(ev, Progress):
                    if ev.done < ev.total:
                        yield f": keep-alive {ev.done}/{ev.total}\n\n"
                    continue
                if isinstance(ev, Failed):
                    finished = True
                    yield f"data: {json.dumps(ev.error.body(), ensure_ascii=False)}\n\n"
                    yield "data: [DONE]\n\n"
                    return
                e = asm.logprob_entry(ev, text_len)
                segs = asm.segments(ev)
                if chat:
                    delta = {}
                    for kind, t in segs:
                        key = "reasoning_content" if kind == "reasoning" else "content"
                        delta[key] = delta.get(key, "") + t
                    if delta or e is not None:
                        yield chunk({"index": 0, "delta": delta,
                                     "logprobs": {"content": [e]} if e is not None else None,
                                     "finish_reason": None})
                else:
                    t = "".join(s for _, s in segs)
                    if t or e is not None:
                        yield chunk({"index": 0, "text": t,
                                     "logprobs": text_logprobs([e]) if e is not None else None,
                                     "finish_reason": None})
                    text_len += len(t)
                if ev.finish_reason is not None:
                    finished = True
                    spec = spec_dict(ev.stats)
                    last = {"index": 0, "finish_reason": ev.finish_reason, "logprobs": None}
                    last.update({"delta": {}} if chat else {"text": ""})
                    yield chunk(last, speculative=spec)
                    if include_usage:
                        yield chunk(None, usage=usage_dict(ev.usage, asm), speculative=spec)
                    yield "data: [DONE]\n\n"
                    return
        finally:
            busy[0] -= 1
            if not finished:
                job.cancel()  # client gone: the worker frees the request's caches

    # ---- endpoints -----------------------------------------------------------

    @app.post("/v1/chat/completions", response_model=None, tags=["completions"],
              responses={200: {"model": ChatCompletionResponse,
                               "content": {"text/event-stream": {}}}, **_ERRORS})
    async def chat_completions(body: ChatCompletionRequest, request: Request):
        """Chat completion (OpenAI format; ``stream: true`` for server-sent events)."""
        check_model(body.model)
        if body.top_logprobs is not None and body.top_logprobs > 0 and not body.logprobs:
            raise invalid_value("top_logprobs", "requires logprobs to be true")
        job = Job(
            kind="chat",
            messages=chat_messages(body),
            tools=body.tools,
            chat_template_kwargs=body.chat_template_kwargs,
            max_tokens=body.requested_max_tokens() or settings.max_tokens,
            gen_kwargs=gen_kwargs(body),
            block_size=body.num_draft_tokens,
            logprobs=bool(body.logprobs),
            top_logprobs=body.top_logprobs or 0,
        )
        top_n = (body.top_logprobs or 0) if body.logprobs else -1
        include_usage = bool(body.stream_options and body.stream_options.include_usage)
        return await run(request, job, bool(body.stream), include_usage, top_n)

    @app.post("/v1/completions", response_model=None, tags=["completions"],
              responses={200: {"model": CompletionResponse,
                               "content": {"text/event-stream": {}}}, **_ERRORS})
    async def completions(body: CompletionRequest, request: Request):
        """Text completion of a raw prompt (no chat template)."""
        check_model(body.model)
        if body.echo:
            raise bad_request("echo is not supported", "echo")
        if body.suffix is not None:
            raise bad_request("suffix is not supported", "suffix")
        prompt = body.prompt
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], str):
            prompt = prompt[0]
        if isinstance(prompt, list) and any(t < 0 or t >= engine.vocab_size for t in prompt):
            raise invalid_value("prompt", f"token ids must be in [0, {engine.vocab_size})")
        job = Job(
            kind="text",
            prompt=prompt,
            max_tokens=body.requested_max_tokens() or settings.max_tokens,
            gen_kwargs=gen_kwargs(body),
            block_size=body.num_draft_tokens,
            logprobs=body.logprobs is not None,
            top_logprobs=body.logprobs or 0,
        )
        top_n = body.logprobs if body.logprobs is not None else -1
        include_usage = bool(body.stream_options and body.stream_options.include_usage)
        return await run(request, job, bool(body.stream), include_usage, top_n)

    # mlx_lm.server also answers these paths
    app.add_api_route("/chat/completions", chat_completions, methods=["POST"], include_in_schema=False)
    app.add_api_route("/completions", completions, methods=["POST"], include_in_schema=False)

    def model_card() -> dict:
        return {"id": settings.model_id, "object": "model", "created": created, "owned_by": "mlx_dflash2"}

    @app.get("/v1/models", response_model=ModelList, tags=["models"])
    async def models():
        """The served model (one target with its drafter)."""
        return {"object": "list", "data": [model_card()]}

    @app.get("/v1/models/{model_id:path}", tags=["models"], responses={404: _ERRORS[404]})
    async def model(model_id: str):
        """One model by id."""
        if model_id != settings.model_id:
            raise model_not_found(model_id, settings.model_id)
        return model_card()

    @app.get("/health", response_model=Health, tags=["server"], responses={503: {"model": Health}})
    async def health():
        """``{"status": "ok"}`` while the generation worker runs, else 503."""
        if engine.healthy:
            return {"status": "ok"}
        return JSONResponse({"status": "unavailable"}, status_code=503)

    @app.get("/metrics", tags=["server"], response_class=PlainTextResponse,
             responses={200: {"content": {"text/plain": {}, "application/json": {}}}})
    async def metrics(format: Optional[Literal["json", "prometheus"]] = None):
        """Server metrics: requests, errors, tokens, acceptance length, tok/s.

        Prometheus text format; ``?format=json`` for JSON.
        """
        m = engine.metrics.snapshot()
        m.update(
            requests_active=engine.active,
            requests_waiting=engine.waiting,
            prompt_cache_entries=len(engine.prompt_cache),
            prompt_cache_hits_total=engine.prompt_cache.hits,
            prompt_cache_misses_total=engine.prompt_cache.misses,
            drafter=(engine.model.proposer.name if engine.model.proposer else "none"),
            block_size=engine.config.block_size or engine.model.block_size,
            model=settings.model_id,
        )
        if format == "json":
            m["batch_schedule"] = engine.schedule_summary()  # JSON only: per batch size, what each width measured
            return JSONResponse(m)
        return PlainTextResponse(_prometheus(m), media_type="text/plain; version=0.0.4")

    base_openapi = app.openapi

    def openapi() -> dict:
        """The generated schema, plus what this server instance knows: the model ids it
        accepts and the vocabulary size (bounds of token ids and ``top_k``)."""
        if app.openapi_schema is None:
            schema = base_openapi()
            comps = schema.get("components", {}).get("schemas", {})
            for name in ("ChatCompletionRequest", "CompletionRequest"):
                props = comps.get(name, {}).get("properties", {})
                if "model" in props:
                    ids = [settings.model_id] + [a for a in settings.model_aliases if a != settings.model_id]
                    props["model"]["anyOf"] = [{"type": "string", "enum": ids}, {"type": "null"}]
                for alt in props.get("top_k", {}).get("anyOf", []):
                    if alt.get("type") == "integer":
                        alt["maximum"] = engine.vocab_size
                for alt in props.get("prompt", {}).get("anyOf", []):
                    items = alt.get("items", {})
                    if items.get("type") == "integer":
                        items.update(minimum=0, maximum=engine.vocab_size - 1)
            app.openapi_schema = schema
        return app.openapi_schema

    app.openapi = openapi
    return app


_HELP = {
    "requests_total": ("counter", "Completion requests received, by endpoint."),
    "requests_completed_total": ("counter", "Requests that finished generating."),
    "request_errors_total": ("counter", "Responses with an error status (4xx/5xx)."),
    "requests_cancelled_total": ("counter", "Requests cancelled because the client went away."),
    "requests_active": ("gauge", "Requests being generated."),
    "requests_waiting": ("gauge", "Requests queued for a generation slot."),
    "prompt_tokens_total": ("counter", "Prompt tokens of finished requests."),
    "cached_prompt_tokens_total": ("counter", "Prompt tokens taken from the prompt cache."),
    "generated_tokens_total": ("counter", "Generated tokens of finished requests."),
    "target_forwards_total": ("counter", "Speculative rounds of finished requests, per request (a batched round "
                                         "counts once for each of its requests)."),
    "drafted_tokens_total": ("counter", "Draft tokens proposed."),
    "accepted_tokens_total": ("counter", "Draft tokens accepted."),
    "acceptance_length": ("gauge", "Acceptance length tau: tokens emitted per target forward, all requests."),
    "generation_tokens_per_second": ("gauge", "Generated tokens per second of worker busy time."),
    "busy_s": ("counter", "Seconds the generation worker spent generating."),
    "batch_size": ("gauge", "Requests in the batched round now (rows)."),
    "batch_rounds_total": ("counter", "Batched rounds run (one target forward each)."),
    "batch_rows_total": ("counter", "Requests advanced by batched rounds, summed over the rounds."),
    "batch_size_mean": ("gauge", "Mean requests per batched round."),
    "batch_verified_tokens_per_round": ("gauge", "Mean tokens verified per batched round (anchors and drafts of "
                                                 "all its requests, padding excluded)."),
    **{f"batch_{k}_steps_total": ("counter", f"Batched steps of kind {k!r}: {why}.")
       for k, why in BATCH_STEP_KINDS.items()},
    **{f"batch_{k}_seconds_total": ("counter", f"Seconds of the batched steps of kind {k!r}.")
       for k in BATCH_STEP_KINDS},
    **{f"worker_{k}_seconds_total": ("counter", f"Seconds of the generation worker's {k!r} part: {why}.")
       for k, why in WORKER_PARTS.items()},
    "uptime_s": ("gauge", "Seconds since the server started."),
    "prompt_cache_entries": ("gauge", "Prompt states held in the prompt cache."),
    "prompt_cache_hits_total": ("counter", "Requests that reused a cached prompt prefix."),
    "prompt_cache_misses_total": ("counter", "Requests that found no cached prefix."),
}


def _prometheus(m: dict) -> str:
    lines = [f'# mlx_dflash2 server: model="{m["model"]}" drafter="{m["drafter"]}" block_size={m["block_size"]}']
    for key, (kind, help_) in _HELP.items():
        name = f"mlx_dflash2_{key}"
        lines += [f"# HELP {name} {help_}", f"# TYPE {name} {kind}"]
        v = m[key]
        if isinstance(v, dict):
            lines += [f'{name}{{endpoint="{k}"}} {x}' for k, x in v.items()]
        else:
            lines.append(f"{name} {v}")
    return "\n".join(lines) + "\n"
