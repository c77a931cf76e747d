"""The server's generation engine: one worker thread owns the model.

MLX must not evaluate one model from several threads at once, so a single
worker thread runs every request. It keeps a list of active requests and
advances them **round-robin, one token each** (one ``next()`` on each
request's :func:`~mlx_dflash2.api.stream_generate` generator), so no request
waits for another to finish. Each request has its own target KV cache and
drafter context and greedy decoding is deterministic, so a request's output
equals what it gets alone. (A speculative round verifies a whole block; the
following ``next()`` calls of that request return the round's other tokens at
no cost.) A request's first ``next()`` is its prefill.

Batched rounds: on every supported target (dense, hybrid GatedDeltaNet, sliding
window) every request (greedy or sampled, with logprobs, penalties or logit bias:
:meth:`Engine._batch_sampling`) skips ``stream_generate``; only ``--max-batch 0``, a
request with invalid sampling parameters (``stream_generate`` names the bad field)
or a target whose caches :class:`~mlx_dflash2.batch.SpeculativeBatch` refuses use
the round-robin path. Each keeps its own verifier and random keys
(:func:`~mlx_dflash2.api.request_sampling`, as ``stream_generate`` builds them), and
while it is the batch's only row its rounds are ``stream_generate``'s (the
drafter's adaptive schedule where the request allows it: not a seeded sampled one). They
wait in FIFO order for a row of one :class:`~mlx_dflash2.batch.SpeculativeBatch`
(at most :attr:`EngineConfig.max_batch` rows), join it between rounds
(``add``: the prefill, from the prompt cache's state), and each worker turn
runs one ``step()`` for all rows after the round-robin requests' ``next()``.
Their tokens go through :class:`~mlx_dflash2.api.TextStream` (the text, stop
strings and finish reasons of ``stream_generate``); a request stopped by a
stop string or cancelled leaves the batch (``remove``), its final state goes
to the prompt cache.

The asyncio side (:mod:`.app`) submits :class:`Job` objects and receives
events on the job's ``asyncio.Queue`` (posted thread-safely):
:class:`Admitted`, :class:`Progress` (prefill; the SSE keep-alives),
:class:`TokenOut` (one per token; the last carries usage and statistics) or
:class:`Failed`. Setting :attr:`Job.cancelled` (client gone) makes the worker
close that request's generator, which cuts its caches, and drop it.

Prompt (prefix) cache: :class:`PromptCache` keeps the final
:class:`~mlx_dflash2.speculative.GenerationState` of recent requests (target KV
cache + drafter context + lookup history, for ``state.tokens``). A new request
takes the entry sharing the longest prefix with its prompt: it takes the entry
over when the entry is a prefix of its prompt (a conversation's next turn),
otherwise it works on a copy (:meth:`GenerationState.clone`); the loop then prefills only the rest.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
import uuid
import weakref
from collections import OrderedDict, deque
from dataclasses import dataclass, field
from typing import Any, Optional

import mlx.core as mx

from ..api import TextStream, request_sampling, stream_generate
from ..batch import SpeculativeBatch, WidthSchedule, warm_up_shapes
from ..loading import SpeculativeModel, materialize
from ..sampling import SamplingParams
from ..speculative import PLAIN_PROPOSER, GenerationState
from ..target import TargetCompatibilityError
from .protocol import APIError, bad_request, invalid_value
from .text import TokenText, convert_chat, initial_reasoning_state, top_logprobs, top_logprobs_many

__all__ = ["Engine", "EngineConfig", "Job", "request_ids", "PromptCache", "Admitted", "Progress", "TokenOut",
           "Failed"]

log = logging.getLogger("mlx_dflash2.server")


# ----------------------------------------------------------------------------
# Events (worker -> request handler)
# ----------------------------------------------------------------------------


@dataclass
class Admitted:
    """The prompt is tokenized and the request is active."""

    prompt_tokens: int
    reasoning: bool  # the prompt opened a thinking block


@dataclass
class Progress:
    """Prefill progress (tokens)."""

    done: int
    total: int


@dataclass
class TokenOut:
    """One generated token.

    Attributes:
        text: the next text segment (may be empty; stop strings already cut).
        token: token id.
        finish_reason: ``"stop"`` / ``"length"`` on the last token, else None.
        logprob: the token's log-probability (only if requested; None for an EOS).
        top: ``[(id, logprob)]`` alternatives (only if requested).
        usage: on the last token: prompt_tokens, completion_tokens, cached_tokens.
        stats: on the last token: :class:`~mlx_dflash2.speculative.SpecStats` as a dict.
    """

    text: str
    token: int
    finish_reason: Optional[str] = None
    logprob: Optional[float] = None
    top: Optional[list] = None
    usage: Optional[dict] = None
    stats: Optional[dict] = None


@dataclass
class Failed:
    """The request failed; nothing more follows."""

    error: APIError


# ----------------------------------------------------------------------------
# Jobs
# ----------------------------------------------------------------------------


@dataclass
class Job:
    """One request as the worker sees it.

    Attributes:
        kind: ``"chat"`` (``messages``) or ``"text"`` (``prompt``: text or token ids).
        gen_kwargs: keyword arguments for ``stream_generate`` (sampling,
            processors, stop, seed; ``max_tokens`` is capped to the context).
        max_tokens: requested maximum of generated tokens.
        block_size: B for this request (None: the server's).
        logprobs: compute the emitted tokens' log-probabilities.
        top_logprobs: number of alternatives per token.
        loop, queue: where events are posted (``loop.call_soon_threadsafe``).
        cancelled: set by the handler when the client has gone.
    """

    kind: str
    max_tokens: int
    messages: Optional[list] = None
    prompt: Any = None
    tools: Optional[list] = None
    chat_template_kwargs: Optional[dict] = None
    gen_kwargs: dict = field(default_factory=dict)
    block_size: Optional[int] = None
    logprobs: bool = False
    top_logprobs: int = 0
    loop: Any = None
    queue: Any = None
    cancelled: bool = False
    id: str = field(default_factory=lambda: uuid.uuid4().hex[:12])
    # worker-side
    gen: Any = None
    state: Optional[GenerationState] = None
    cache_state: bool = False
    prompt_ids: list = field(default_factory=list)
    submitted: float = field(default_factory=time.perf_counter)
    # batched requests (see Engine): the arguments of SpeculativeBatch.add, the row's id once joined,
    # the text side of the stream
    batched: bool = False
    join: Optional[dict] = None
    uid: Optional[int] = None
    text: Optional[TextStream] = None

    def cancel(self) -> None:
        """Ask the worker to stop this request and free its caches (idempotent)."""
        self.cancelled = True

    def post(self, event) -> None:
        """Hand an event to the request's handler (any thread)."""
        if self.loop is None or self.queue is None:
            return
        try:
            self.loop.call_soon_threadsafe(self.queue.put_nowait, event)
        except RuntimeError:  # the event loop is closed: nobody is listening
            self.cancelled = True


def request_ids(tok, job: Job, chat_template_args: Optional[dict] = None) -> list[int]:
    """The prompt ids the worker generates from for ``job`` (its messages through ``tok``'s chat template with
    ``chat_template_args`` and the request's own arguments, or its prompt text or ids).

    Raises:
        APIError: a chat template that refuses the request (400).
    """
    if job.kind == "chat":
        if getattr(tok, "has_chat_template", False):
            kwargs = dict(chat_template_args or {})
            kwargs.update(job.chat_template_kwargs or {})
            if job.tools:
                kwargs["tools"] = job.tools
            try:
                ids = tok.apply_chat_template(job.messages, add_generation_prompt=True, **kwargs)
            except Exception as e:  # noqa: BLE001 - template errors are caused by the request
                log.info("chat template refused request %s: %r", job.id, e)
                raise bad_request(f"could not apply the chat template: {e}", "messages") from e
            if isinstance(ids, dict) or hasattr(ids, "keys"):
                ids = ids["input_ids"]
            return [int(t) for t in ids]
        return tok.encode(convert_chat(job.messages))
    if isinstance(job.prompt, str):
        add_special = tok.bos_token is None or not job.prompt.startswith(tok.bos_token)
        return tok.encode(job.prompt, add_special_tokens=add_special)
    return [int(t) for t in job.prompt]


def internal_error(e: BaseException) -> APIError:
    """The 500 error a request gets when the worker failed on it: the exception's type and message."""
    return APIError(500, f"internal error: {type(e).__name__}: {e}")


def _deliver(items: list) -> None:
    """Put each ``(queue, event)`` of ``items`` into its queue, in order (on the requests' event loop)."""
    for q, event in items:
        q.put_nowait(event)


def post_all(items: list) -> None:
    """Hand ``(job, event)`` pairs to their requests' handlers with **one** ``call_soon_threadsafe`` per event
    loop (each job's events in order): a batched step's tokens for every request at once. A post per token
    wakes the HTTP thread once per token, and each wake-up's ``send`` on the loop's self-pipe releases the GIL,
    so the HTTP thread took it mid-emission and the worker waited for its turn at every token (issue 22: an
    eval releases the GIL too, and getting it back beside a busy thread costs up to the switch interval, 5 ms).
    A request whose loop is closed is marked cancelled (nobody is listening), as :meth:`Job.post` does."""
    by_loop: dict = {}
    for job, event in items:
        if job.loop is not None and job.queue is not None:
            by_loop.setdefault(id(job.loop), (job.loop, []))[1].append((job, event))
    for loop, pairs in by_loop.values():
        try:
            loop.call_soon_threadsafe(_deliver, [(job.queue, event) for job, event in pairs])
        except RuntimeError:  # the event loop is closed
            for job, _ in pairs:
                job.cancelled = True


# ----------------------------------------------------------------------------
# Prompt cache
# ----------------------------------------------------------------------------


def common_prefix(a: list[int], b: list[int]) -> int:
    """Length of the longest common prefix of two token lists."""
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i


def state_nbytes(state: GenerationState) -> int:
    """Bytes of device memory held by a state's target KV cache and drafter context."""
    import mlx.core as mx
    from mlx.utils import tree_flatten

    n = 0
    for c in state.cache or []:
        n += sum(a.nbytes for _, a in tree_flatten(c.state) if isinstance(a, mx.array))
    seen = set()
    for snap in state.snapshots.values():  # recurrent-state snapshots of hybrid targets
        for _, arrays in snap:
            for a in arrays:
                if a is not None and id(a) not in seen:
                    seen.add(id(a))
                    n += a.nbytes
    if state.session is not None:
        n += sum(a.nbytes for a in state.session.held_arrays())  # (a drafter's queue counted, not appended)
    return n


class PromptCache:
    """LRU of :class:`GenerationState` objects, matched by longest common token prefix.

    Only the worker thread uses it.

    Args:
        max_entries: at most this many states are kept (0 disables the cache).
        max_bytes: and at most this many bytes of caches (None: no byte limit).
    """

    def __init__(self, max_entries: int, max_bytes: Optional[int] = None):
        self.max_entries = max(0, int(max_entries))
        self.max_bytes = max_bytes
        self._entries: "OrderedDict[int, GenerationState]" = OrderedDict()
        self.hits = 0
        self.misses = 0

    def __len__(self) -> int:
        return len(self._entries)

    @property
    def nbytes(self) -> int:
        return sum(state_nbytes(s) for s in self._entries.values())

    def clear(self) -> None:
        self._entries.clear()

    def fetch(self, prompt: list[int], proposer) -> GenerationState:
        """A state for a request with ``prompt``: the best entry (taken over or
        copied) or a fresh one. The caller owns the result."""
        best, best_n = None, 0
        for key, st in self._entries.items():  # oldest first: ties go to the most recent
            if st.proposer is not proposer or not st.tokens or st.cache is None:
                continue
            n = common_prefix(st.tokens, prompt)
            if n >= best_n and n > 0:
                best, best_n = key, n
        if best is None:
            self.misses += 1
            return GenerationState()
        self.hits += 1
        st = self._entries[best]
        if best_n >= len(st.tokens):
            del self._entries[best]  # a prefix of the prompt: the request extends it
            return st
        self._entries.move_to_end(best)
        return st.clone()

    def put(self, state: GenerationState) -> None:
        """Keep a finished request's state (it must not be used elsewhere afterwards)."""
        if self.max_entries == 0 or state.cache is None or not state.tokens:
            return
        # entries that are a prefix of this one are superseded by it
        for key in [k for k, s in self._entries.items()
                    if s.proposer is state.proposer and len(s.tokens) <= len(state.tokens)
                    and common_prefix(s.tokens, state.tokens) == len(s.tokens)]:
            del self._entries[key]
        self._entries[id(state)] = state
        while len(self._entries) > self.max_entries:
            self._entries.popitem(last=False)
        if self.max_bytes is not None:
            while self._entries and self.nbytes > self.max_bytes:
                self._entries.popitem(last=False)


# ----------------------------------------------------------------------------
# Metrics
# ----------------------------------------------------------------------------


#: the kinds of batched steps that ``GET /metrics`` counts (steps and seconds), with what each is
BATCH_STEP_KINDS = {
    "join": "the step prefilled joining requests, then ran a round",
    "lone": "a round of one request (the single-request rounds)",
    "drafting": "a round of several requests that verified drafts",
    "plain": "a round of several requests, one token each",
}

#: the generation worker's own work around the batched steps that ``GET /metrics`` times (seconds), with what each
#: is: with the steps (:data:`BATCH_STEP_KINDS`) they split the worker's busy time ("post" aside), so a server
#: slower than another on the same rounds shows where (issue 22: the drafter's server ran 0.74x the plain one's
#: rounds on an H100)
WORKER_PARTS = {
    "start": "setting requests up (template, tokens, checks, prompt-cache lookup)",
    "add": "adding requests to the batch (their proposer sessions, queued prefill)",
    "emit": "handing out the steps' tokens (text, stop strings, logprobs, events)",
    "close": "ending requests (their states taken from the batch, the prompt cache's put)",
    "post": "handing the turns' events to the HTTP threads (post_all): inside a step's time where the step waited "
            "for the device, else after the turn, outside the busy time",
}


class Metrics:
    """Counters of the server (thread-safe)."""

    def __init__(self):
        self.lock = threading.Lock()
        self.started = time.time()
        self.requests = {"chat": 0, "text": 0}
        self.completed = 0
        self.errors = 0
        self.cancelled = 0
        self.prompt_tokens = 0
        self.cached_tokens = 0
        self.generated_tokens = 0
        self.rounds = 0
        self.round_tokens = 0
        self.drafted = 0
        self.accepted = 0
        self.busy_s = 0.0
        self.batch_rounds = 0
        self.batch_rows = 0
        self.batch_verified = 0
        self.batch_size = 0  # rows of the last batched round
        # the batched steps by kind (BATCH_STEP_KINDS): how many, and the seconds of their SpeculativeBatch.step
        self.batch_steps = {k: 0 for k in BATCH_STEP_KINDS}
        self.batch_step_s = {k: 0.0 for k in BATCH_STEP_KINDS}
        self.worker_s = {k: 0.0 for k in WORKER_PARTS}  # seconds of the worker's parts (WORKER_PARTS)

    def worker(self, part: str, seconds: float) -> None:
        """Add ``seconds`` of the worker's ``part`` (one of :data:`WORKER_PARTS`)."""
        with self.lock:
            self.worker_s[part] += seconds

    def batch_step(self, kind: str, seconds: float) -> None:
        """Count one batched step of ``kind`` (one of :data:`BATCH_STEP_KINDS`) that took ``seconds``."""
        with self.lock:
            self.batch_steps[kind] += 1
            self.batch_step_s[kind] += seconds

    def add(self, **kw) -> None:
        with self.lock:
            for k, v in kw.items():
                setattr(self, k, getattr(self, k) + v)

    def request(self, kind: str) -> None:
        with self.lock:
            self.requests[kind] = self.requests.get(kind, 0) + 1

    def snapshot(self) -> dict:
        with self.lock:
            return {
                "uptime_s": time.time() - self.started,
                "requests_total": dict(self.requests),
                "requests_completed_total": self.completed,
                "request_errors_total": self.errors,
                "requests_cancelled_total": self.cancelled,
                "prompt_tokens_total": self.prompt_tokens,
                "cached_prompt_tokens_total": self.cached_tokens,
                "generated_tokens_total": self.generated_tokens,
                "target_forwards_total": self.rounds,
                "drafted_tokens_total": self.drafted,
                "accepted_tokens_total": self.accepted,
                "acceptance_length": self.round_tokens / self.rounds if self.rounds else 0.0,
                "busy_s": self.busy_s,
                "batch_size": self.batch_size,
                "batch_rounds_total": self.batch_rounds,
                "batch_rows_total": self.batch_rows,
                "batch_size_mean": self.batch_rows / self.batch_rounds if self.batch_rounds else 0.0,
                "batch_verified_tokens_per_round": (self.batch_verified / self.batch_rounds
                                                    if self.batch_rounds else 0.0),
                "generation_tokens_per_second": self.generated_tokens / self.busy_s if self.busy_s > 0 else 0.0,
                **{f"batch_{k}_steps_total": v for k, v in self.batch_steps.items()},
                **{f"batch_{k}_seconds_total": v for k, v in self.batch_step_s.items()},
                **{f"worker_{k}_seconds_total": v for k, v in self.worker_s.items()},
            }


# ----------------------------------------------------------------------------
# Engine
# ----------------------------------------------------------------------------


@dataclass
class EngineConfig:
    """Server-side settings of the engine.

    Attributes:
        block_size: default B (None: the drafter's).
        max_context: limit on prompt + generated tokens (None: the target's).
        prompt_cache_size: cached prompt states (0: no prompt cache).
        prompt_cache_bytes: byte limit of the prompt cache (None: none).
        decode_concurrency: active requests at most; more wait in FIFO order.
        max_batch: requests sharing one batched round at most (0: no batching, every request
            is advanced on its own, round-robin); more eligible requests wait in FIFO order. Default 32, as
            ``mlx_lm.server``'s ``--decode-concurrency`` (with 8, 16 clients on the 2-core CPU got 58.4 tok/s
            against its 69.4, half of them waiting for a row; with 32, 78.5: session 27).
        prefill_step_size: prompt chunk (tokens) between prefill progress events.
        batch_schedule: verify widths of batched rounds: ``"auto"`` (capped by measured throughput,
            :class:`~mlx_dflash2.batch.WidthSchedule`) or ``"full"`` (every row its whole proposal).
        warmup: run the batched rounds' shapes once at start (:meth:`~mlx_dflash2.batch.SpeculativeBatch.warm_up`:
            2 .. ``max_batch`` rows, the schedule's widths up to B), so that a GPU backend builds its kernels
            for them before serving (MLX's CUDA backend stalled a round for 24 s on a shape class first met
            mid-serving); ``None`` (default): on a GPU backend only. Run by :meth:`Engine.start`, on the
            worker's thread (MLX keeps compiled traces per thread), before the worker serves.
        chat_template_args: default chat template arguments.
    """

    block_size: Optional[int] = None
    max_context: Optional[int] = None
    prompt_cache_size: int = 10
    prompt_cache_bytes: Optional[int] = None
    decode_concurrency: int = 32
    max_batch: int = 32
    prefill_step_size: int = 2048
    batch_schedule: str = "auto"
    warmup: Optional[bool] = None
    chat_template_args: dict = field(default_factory=dict)


_PARAMS = [("repetition_context_size", "repetition_context_size"), ("presence_context_size", "presence_context_size"),
           ("frequency_context_size", "frequency_context_size"), ("temp", "temperature"), ("top_p", "top_p"),
           ("top_k", "top_k"), ("min_p", "min_p"),
           ("repetition_penalty", "repetition_penalty"), ("presence_penalty", "presence_penalty"),
           ("frequency_penalty", "frequency_penalty"), ("logit_bias", "logit_bias"), ("max_tokens", "max_tokens")]


def _param_of(message: str) -> Optional[str]:
    """The request field an error of ``stream_generate`` is about (best effort)."""
    for key, param in _PARAMS:
        if key in message:
            return param
    return None


class Engine:
    """Owns the model; serves :class:`Job` objects on one worker thread.

    Args:
        model: from :func:`mlx_dflash2.load`.
        tokenizer: the target's ``TokenizerWrapper``.
        config: :class:`EngineConfig`.

    Build it on the thread that loaded ``model``: the worker thread runs the
    model, and MLX cannot evaluate on one thread an array left lazy by another,
    so everything the model holds is evaluated here
    (:func:`~mlx_dflash2.loading.materialize`).

    Call :meth:`start` before :meth:`submit`, :meth:`stop` at shutdown.
    """

    def __init__(self, model: SpeculativeModel, tokenizer, config: Optional[EngineConfig] = None):
        materialize(model)
        self.model = model
        self.tokenizer = tokenizer
        self.config = config or EngineConfig()
        limits = [x for x in (self.config.max_context, model.target.max_context) if x]
        self.max_context: Optional[int] = min(limits) if limits else None
        self.prompt_cache = PromptCache(self.config.prompt_cache_size, self.config.prompt_cache_bytes)
        self.metrics = Metrics()
        self.token_text = TokenText(tokenizer)
        self.vocab_size = len(tokenizer)
        self._inbox: "queue.Queue[Job]" = queue.Queue()
        self._waiting: deque = deque()
        self._active: list[Job] = []
        self._stopping = threading.Event()
        self._thread: Optional[threading.Thread] = None
        self._call_lock = threading.Lock()
        self._calls: list = []
        # submitted jobs by id, for abort_all (any thread; Job is an unhashable dataclass)
        self._jobs: "weakref.WeakValueDictionary[str, Job]" = weakref.WeakValueDictionary()
        self._jobs_lock = threading.Lock()
        # batched rounds (every request, on every supported target); None: every request goes round-robin
        self._batch: Optional[SpeculativeBatch] = None
        if self.config.max_batch > 0:
            try:
                self._batch = self._new_batch()
            except TargetCompatibilityError as e:
                log.info("batched rounds off: %s", e)
        warm = self.config.warmup
        if warm is None:
            warm = mx.default_device().type == mx.DeviceType.gpu
        # run by the worker's thread before it serves (start waits for it): MLX keeps compiled traces per thread, so
        # a warm-up on the loading thread left the worker to trace every batch shape again mid-serving (a traced
        # function's first call on a new thread: 5.5 ms against 1.3 ms on this CPU, session 49)
        self._warm_at_start = self._batch is not None and bool(warm) and self.config.max_batch >= 2
        self._ready = threading.Event()
        self._start_lock = threading.Lock()  # start's swap of the worker (see there)
        self._died: Optional[BaseException] = None  # what ended the worker before it served (start raises it)
        self._batch_queue: deque = deque()  # batched jobs not yet joined (FIFO)
        self._batched: dict = {}  # row uid -> job
        self._closing_s = 0.0  # seconds of _close since the emissions of the step began (kept out of "emit")
        self._outbox: list = []  # (job, event) posted by the worker's turn, handed out together (_post: at its end,
        # or inside the next batched step)

    def warm_up(self) -> dict:
        """Run the batched rounds' shapes once (:meth:`~mlx_dflash2.batch.SpeculativeBatch.warm_up`): row counts
        2, 3, 4, 6, 8, 12, ... up to ``max_batch``, verify widths 1, 2, 4, ... up to the block size B (1 only
        without a proposer), the model's proposer drafting; logged with its seconds. Call it on the thread that
        runs the rounds (:meth:`start` does, on the worker's): MLX's compiled traces are per thread.

        Returns:
            ``{"shapes": ..., "seconds": ...}`` (nothing run without batching).
        """
        if self._batch is None:
            return {"shapes": 0, "seconds": 0.0}
        m, mb = self.model, self.config.max_batch
        B = (self.config.block_size or m.block_size) if m.proposer is not None else 1
        rows, widths = warm_up_shapes(mb, B)
        out = self._batch.warm_up(rows, widths, proposer=m.proposer, block_size=B, stop=self._stopping.is_set)
        if self._stopping.is_set():
            log.info("the batched rounds' warm-up stopped after %.1f s (%d shapes): the server is stopping",
                     out["seconds"], out["shapes"])
        else:
            log.info("warmed the batched rounds up in %.1f s: %d row counts (2 .. %d) x widths %s",
                     out["seconds"], len(rows), mb, ",".join(map(str, widths)))
        return out

    def _new_batch(self) -> SpeculativeBatch:
        batch = SpeculativeBatch(self.model.target, prefill_step_size=self.config.prefill_step_size,
                                 schedule=self.config.batch_schedule)
        batch.on_wait = self._flush_outbox  # the last turn's events, handed out while the device works
        return batch

    # ---- lifecycle -------------------------------------------------------

    def start(self) -> None:
        """Start the generation worker and wait until it serves: its first start runs the batched rounds'
        warm-up (``EngineConfig.warmup``) on the worker's own thread first (a failing warm-up is logged and
        the worker serves without it). A second call while the worker starts waits for it too; a call while a
        stop is still under way (its join timed out) waits for that worker to end, then starts a new one.

        Raises:
            RuntimeError: the worker ended before it served (an error that is not an ``Exception``).
        """
        with self._start_lock:  # (a start waiting below sees the worker and the stop flag swapped together)
            old = self._thread
            if old is not None and old.is_alive() and self._stopping.is_set():
                old.join()  # a stop still under way (its join timed out, e.g. during the warm-up): afresh after it
            if self._thread is None or not self._thread.is_alive():
                self._stopping.clear()
                self._ready.clear()
                self._died = None
                self._thread = threading.Thread(target=self._run, name="mlx_dflash2-generation", daemon=True)
                self._thread.start()
        while True:  # (a second start waits for the first's; a start whose stopped worker a later start replaced
            # waits for the new one)
            th = self._thread
            if self._ready.wait(0.25):
                break
            if not th.is_alive():
                with self._start_lock:
                    if self._thread is th:
                        break
        with self._start_lock:
            th, died, stopping = self._thread, self._died, self._stopping.is_set()
        if died is not None or (not th.is_alive() and not stopping):
            raise RuntimeError("the generation worker ended while it started"
                               + (f" ({type(died).__name__}: {died})" if died is not None else "")) from died

    def _warm_up_once(self) -> None:
        """The start-up warm-up, on the worker's thread (see :meth:`start`)."""
        if self._warm_at_start:
            self._warm_at_start = False
            try:
                self.warm_up()
            except Exception as e:  # an optimisation only: serve without it (named in the log)
                log.warning("the batched rounds' warm-up failed (%s: %s); serving without it",
                            type(e).__name__, e)

    def stop(self, timeout: float = 10.0) -> None:
        """Stop the worker (a start-up warm-up ends at its next batch shape) and wait up to ``timeout`` seconds for
        it (0: only ask, e.g. from a signal handler)."""
        self._stopping.set()
        if self._thread is not None:
            self._thread.join(timeout)

    @property
    def healthy(self) -> bool:
        return (self._thread is not None and self._thread.is_alive() and not self._stopping.is_set()
                and self._died is None)

    @property
    def active(self) -> int:
        return len(self._active)

    @property
    def waiting(self) -> int:
        return len(self._waiting) + self._inbox.qsize()

    def submit(self, job: Job) -> None:
        """Queue a job (any thread)."""
        self.metrics.request(job.kind)
        with self._jobs_lock:
            self._jobs[job.id] = job
        self._inbox.put(job)

    def abort_all(self, message: str = "the server is shutting down") -> int:
        """End every submitted request that is not over with a 503 ``server_shutdown`` error (any thread).

        Each handler gets a :class:`Failed` event at once (its stream ends with an error event and ``[DONE]``,
        a plain request answers 503) and the job is cancelled, so the worker drops it at its next step. What
        :class:`~.app.AppServer` does on uvicorn's force quit (a second Ctrl-C) instead of letting uvicorn
        cancel the handlers mid-response. Returns the number of requests ended.
        """
        with self._jobs_lock:
            jobs = [j for j in self._jobs.values() if not j.cancelled]
        err = APIError(503, message, code="server_shutdown")
        for job in jobs:
            job.post(Failed(err))
            job.cancel()
        return len(jobs)

    def call(self, fn, timeout: float = 60.0):
        """Run ``fn()`` on the worker thread between steps and return its result
        (for tests and maintenance, e.g. clearing the prompt cache)."""
        done = threading.Event()
        box: dict = {}

        def wrapper():
            try:
                box["result"] = fn()
            except BaseException as e:  # noqa: BLE001 - re-raised in the caller
                box["error"] = e
            done.set()

        with self._call_lock:
            self._calls.append(wrapper)
        self._inbox.put(None)  # wake the worker
        if not done.wait(timeout):
            raise TimeoutError("the generation worker did not answer")
        if "error" in box:
            raise box["error"]
        return box.get("result")

    # ---- worker ----------------------------------------------------------

    def _run(self) -> None:
        try:
            self._warm_up_once()
        except BaseException as e:  # (an Exception is caught inside: this ends the worker) for start to raise
            self._died = e
            raise
        finally:
            self._ready.set()
        while not self._stopping.is_set():
            try:
                self._drain(block=not self._active and not self._waiting)
                self._run_calls()
                self._admit()
                if self._active:
                    tic = time.perf_counter()
                    for job in list(self._active):
                        if not job.batched:
                            self._step(job)
                    if self._batch is not None:
                        self._batch_turn()
                    self.metrics.add(busy_s=time.perf_counter() - tic)
            except Exception:  # noqa: BLE001 - the worker must survive anything
                log.exception("generation worker error")
                self._flush_outbox()
            else:
                if not self._next_turn_waits():
                    self._flush_outbox()
        self._flush_outbox()  # (a stop landing while a turn's events waited for the next step: they go out first)
        for job in list(self._active) + list(self._waiting):
            self._close(job)
            job.post(Failed(APIError(503, "the server is shutting down", code="server_shutdown")))
        # this thread's MLX streams go with it, not in the interpreter's teardown: MLX asks threads to call
        # clear_streams() at their end (ml-explore/mlx#4110, #4327); without it a server stopped with Ctrl-C
        # sometimes aborted with "terminate called without an active exception" (exit -6; one run in four here)
        mx.clear_streams()

    def _post(self, job: Job, event) -> None:
        """Queue ``event`` for ``job``'s handler: the turn's events are handed out together (:func:`post_all`),
        at the end of the turn, or, where the next turn is a batched step of every active request, where that
        step waits for the device (``SpeculativeBatch.on_wait``): handing them out wakes the HTTP thread, which
        takes the GIL; while the worker builds the next round's graph that stalls the round (session 48: the
        self-pipe's ``send`` of ``call_soon_threadsafe`` was the worker's most frequent handoff under load)."""
        self._outbox.append((job, event))

    def _next_turn_waits(self) -> bool:
        """Whether the outbox may wait for the next turn's batched step (its ``on_wait``): every active request
        is a row of the batch and the batch has a step to run (else nothing would hand them out soon)."""
        b = self._batch
        return (b is not None and bool(self._outbox) and bool(b.active or b.pending)
                and all(job.batched for job in self._active) and not self._stopping.is_set())

    def _flush_outbox(self) -> None:
        if self._outbox:
            tic = time.perf_counter()
            items, self._outbox = self._outbox, []
            post_all(items)
            self.metrics.worker("post", time.perf_counter() - tic)

    def _drain(self, block: bool) -> None:
        try:
            job = self._inbox.get(timeout=0.1) if block else self._inbox.get_nowait()
        except queue.Empty:
            return
        while True:
            if job is not None:
                self._waiting.append(job)
            try:
                job = self._inbox.get_nowait()
            except queue.Empty:
                return

    def _run_calls(self) -> None:
        with self._call_lock:
            calls, self._calls = self._calls, []
        for c in calls:
            c()

    def _admit(self) -> None:
        while self._waiting and len(self._active) < max(1, self.config.decode_concurrency):
            job = self._waiting.popleft()
            if job.cancelled:
                self.metrics.add(cancelled=1)
                continue
            tic = time.perf_counter()
            try:
                self._start(job)
            except APIError as e:
                self._fail(job, e)
            except Exception as e:  # noqa: BLE001
                log.exception("request %s could not start", job.id)
                self._fail(job, internal_error(e))
            self.metrics.worker("start", time.perf_counter() - tic)

    def _tokenize(self, job: Job) -> list[int]:
        return request_ids(self.tokenizer, job, self.config.chat_template_args)

    def _start(self, job: Job) -> None:
        ids = self._tokenize(job)
        param = "messages" if job.kind == "chat" else "prompt"
        if not ids:
            raise bad_request("the prompt is empty (no tokens)", param)
        if job.kind == "text" and any(t < 0 or t >= self.vocab_size for t in ids):
            raise invalid_value("prompt", f"token ids must be in [0, {self.vocab_size})")
        limit = self.max_context
        max_tokens = job.max_tokens
        if limit is not None:
            if len(ids) >= limit:
                raise APIError(
                    400,
                    f"This model's maximum context length is {limit} tokens; the prompt has {len(ids)} tokens "
                    "and must leave room for at least one generated token.",
                    param,
                    "context_length_exceeded",
                )
            max_tokens = min(max_tokens, limit - len(ids))
        m = self.model
        B = job.block_size or self.config.block_size or m.block_size
        job.cache_state = self.prompt_cache.max_entries > 0
        # the proposer the loop will use (plain decoding has its own, shared one)
        proposer = m.proposer if (m.proposer is not None and B > 1) else PLAIN_PROPOSER
        job.state = self.prompt_cache.fetch(ids, proposer) if job.cache_state else GenerationState()
        job.prompt_ids = ids

        def progress(done: int, total: int) -> None:
            job.post(Progress(done, total))

        rs = self._batch_sampling(job, max_tokens)
        if rs is not None:
            # it joins the batched round (below, _batch_turn) when a row is free
            cap = max_tokens
            if m.target.max_context is not None:  # as stream_generate: the target's own limit is a length cap
                room = m.target.max_context - len(ids) + 1
                cap = room if cap < 0 else min(cap, room)
            job.batched = True
            job.text = TextStream(self.tokenizer, job.gen_kwargs.get("stop"), cap)
            job.join = dict(prompt=ids, max_tokens=max_tokens, proposer=proposer,
                            block_size=B if m.proposer is not None else 1, verifier=rs.verifier,
                            draft_temperature=rs.draft_temperature, draft_key=rs.draft_key,
                            logprobs=job.logprobs, adaptive=rs.adaptive,
                            eos_token_ids=list(self.tokenizer.eos_token_ids), state=job.state,
                            keep_state=job.cache_state, prompt_progress_callback=progress)
            job.state = None  # the batch owns it from the join on
            self._batch_queue.append(job)
            self._active.append(job)
            reasoning = job.kind == "chat" and initial_reasoning_state(self.tokenizer, ids)
            job.post(Admitted(len(ids), reasoning))
            return

        job.gen = stream_generate(
            m,
            self.tokenizer,
            ids,
            max_tokens=max_tokens,
            block_size=B,
            prefill_step_size=self.config.prefill_step_size,
            prompt_progress_callback=progress,
            state=job.state,
            **job.gen_kwargs,
        )
        self._active.append(job)
        reasoning = job.kind == "chat" and initial_reasoning_state(self.tokenizer, ids)
        job.post(Admitted(len(ids), reasoning))

    def _step(self, job: Job) -> None:
        if job.cancelled:
            self._close(job)
            self.metrics.add(cancelled=1)
            log.info("request %s cancelled (client gone)", job.id)
            return
        try:
            r = next(job.gen)
        except StopIteration:
            self._close(job)
            self._fail(job, APIError(500, "generation ended without a final response"))
            return
        except (ValueError, NotImplementedError) as e:
            self._close(job)
            self._fail(job, bad_request(str(e), _param_of(str(e))))
            return
        except Exception as e:  # noqa: BLE001
            log.exception("request %s failed", job.id)
            self._close(job)
            self._fail(job, internal_error(e))
            return
        out = TokenOut(r.text, int(r.token), r.finish_reason)
        is_eos = r.finish_reason == "stop" and out.token in self.tokenizer.eos_token_ids
        if job.logprobs and not is_eos:
            out.logprob, out.top = top_logprobs(r.logprobs, out.token, job.top_logprobs)
        if r.finish_reason is not None:
            s = r.stats
            out.usage = {
                "prompt_tokens": r.prompt_tokens,
                "completion_tokens": r.generation_tokens,
                "cached_tokens": s.cached_tokens,
            }
            out.stats = s.as_dict()
            self.metrics.add(
                completed=1,
                prompt_tokens=r.prompt_tokens,
                cached_tokens=s.cached_tokens,
                generated_tokens=r.generation_tokens,
                rounds=s.rounds,
                round_tokens=s.round_tokens,
                drafted=s.drafted,
                accepted=s.accepted,
            )
            self._close(job, keep=True)
        self._post(job, out)

    def _close(self, job: Job, keep: bool = False) -> None:
        """Close the request's generator (its caches are cut to the emitted tokens) or take it out of
        the batch (its row is freed), and keep its state in the prompt cache or drop it."""
        tic = time.perf_counter()
        try:
            self._close_job(job, keep)
        finally:
            dt = time.perf_counter() - tic
            self._closing_s += dt
            self.metrics.worker("close", dt)

    def _close_job(self, job: Job, keep: bool) -> None:
        if job.uid is not None:
            try:
                st = self._batch.remove(job.uid)  # still a row (stopped by a stop string, cancelled)
                job.state = st if st is not None else self._batch.take_state(job.uid)
            except Exception:  # noqa: BLE001
                log.exception("removing request %s from the batch", job.id)
                keep, job.state = False, None
            self._batched.pop(job.uid, None)
            job.uid = None
        job.join = None
        if job.gen is not None:
            try:
                job.gen.close()
            except Exception:  # noqa: BLE001
                log.exception("closing request %s", job.id)
                keep = False
            job.gen = None
        if job in self._active:
            self._active.remove(job)
        if keep and job.cache_state and job.state is not None:
            try:
                self.prompt_cache.put(job.state)
            except Exception:  # noqa: BLE001 - keeping the state is an optimisation: the request has finished
                log.exception("keeping request %s's state in the prompt cache", job.id)
        job.state = None

    # ---- batched rounds ----------------------------------------------------

    def schedule_summary(self) -> dict | None:
        """The batched rounds' width schedule as measured so far (:meth:`WidthSchedule.summary`), or None
        (no batching, or a fixed schedule)."""
        batch = self._batch
        sch = getattr(batch, "schedule", None)
        return sch.summary() if isinstance(sch, WidthSchedule) else None

    def _batch_sampling(self, job: Job, max_tokens: int):
        """The sampling (:class:`~mlx_dflash2.api.RequestSampling`: verifier, draft temperature and key)
        of a request that joins the batched round, or None (it goes round-robin through
        ``stream_generate``): every request of a batched engine (greedy or sampled, logprobs, penalties,
        logit bias); a request whose parameters are invalid is left to ``stream_generate``, which names
        the bad field."""
        if self._batch is None or max_tokens == 0:
            return None
        kw = {k: v for k, v in job.gen_kwargs.items() if k != "stop"}
        try:
            params = SamplingParams(**kw).validate()
        except (TypeError, ValueError):
            return None
        return request_sampling(params, kernel_mode=getattr(self.model, "kernels", None))

    def _batch_turn(self) -> None:
        """One turn of the batched requests: drop the cancelled ones, join waiting ones (FIFO) while
        rows are free, run one round, hand out each request's tokens."""
        batch = self._batch
        for job in [j for j in self._active if j.batched and j.cancelled]:
            self._close(job)
            self.metrics.add(cancelled=1)
            log.info("request %s cancelled (client gone)", job.id)
        while self._batch_queue and batch.active < self.config.max_batch:
            job = self._batch_queue.popleft()
            if job not in self._active or job.join is None:  # closed while waiting
                continue
            tic, self._closing_s = time.perf_counter(), 0.0
            try:
                job.uid = batch.add(**job.join)
                job.join = None
                self._batched[job.uid] = job
            except (ValueError, NotImplementedError) as e:
                self._close(job)
                self._fail(job, bad_request(str(e), _param_of(str(e))))
            except Exception as e:  # noqa: BLE001
                log.exception("request %s could not join the batch", job.id)
                self._close(job)
                self._fail(job, internal_error(e))
            self.metrics.worker("add", time.perf_counter() - tic - self._closing_s)  # (a failed join's end: "close")
        if not (batch.active or batch.pending):
            with self.metrics.lock:  # cancellations may have emptied it
                self.metrics.batch_size = batch.active
            return
        tic = time.perf_counter()
        try:
            events = batch.step()
        except Exception as e:  # noqa: BLE001 - the batch's state is unknown: fail its requests, start afresh
            log.exception("batched round failed")
            for job in list(self._batched.values()):
                job.uid = None
                self._close(job)
                self._fail(job, internal_error(e))
            self._batched.clear()
            self._batch = self._new_batch()
            return
        r = batch.last_round
        if r["rows"]:
            self.metrics.add(batch_rounds=1, batch_rows=r["rows"], batch_verified=r["verified"])
        if r["rows"] or batch.last_prefill["rows"]:
            kind = ("join" if batch.last_prefill["rows"] else "lone" if r["rows"] == 1
                    else "drafting" if r["verified"] > r["rows"] else "plain")
            self.metrics.batch_step(kind, time.perf_counter() - tic)
        tic, self._closing_s = time.perf_counter(), 0.0
        # the step's log-probabilities, read together (one evaluation, not three per token: top_logprobs_many)
        want = [(ev, i) for ev in events if ev.logprobs and getattr(self._batched.get(ev.uid), "logprobs", False)
                for i in range(len(ev.tokens))]
        try:
            lps = dict(zip([(ev.uid, i) for ev, i in want], top_logprobs_many(
                [(ev.logprobs[i], int(ev.tokens[i]), self._batched[ev.uid].top_logprobs) for ev, i in want])))
        except Exception as e:  # noqa: BLE001 - the requests that asked for them fail; the others' tokens go out
            log.exception("reading the step's log-probabilities")
            lps = {}
            for uid in dict.fromkeys(ev.uid for ev, _ in want):
                job = self._batched.get(uid)
                if job is not None:
                    self._close(job)
                    self._fail(job, internal_error(e))
        for ev in events:
            job = self._batched.get(ev.uid)
            if job is not None:
                try:
                    self._emit(job, ev, lps)
                except Exception as e:  # noqa: BLE001 - that request fails; the step's other events still go out
                    log.exception("request %s: its tokens could not be handed out", job.id)
                    self._close(job)
                    self._fail(job, internal_error(e))
        self.metrics.worker("emit", time.perf_counter() - tic - self._closing_s)  # the requests' ends: "close"
        with self.metrics.lock:  # after the emissions: a request ended by a stop string has left the batch
            self.metrics.batch_size = batch.active

    def _emit(self, job: Job, ev, lps: dict) -> None:
        """Post a batch event's tokens to the request, exactly as ``stream_generate`` would yield them
        (text, stop strings, finish reason, usage); a request that finishes leaves the batch. ``lps``: its
        tokens' ``(logprob, top)`` by ``(uid, index)``, read for the whole step (a request with logprobs)."""
        for i, tok in enumerate(ev.tokens):
            text, finish = job.text.add(tok)
            if finish is None and i == len(ev.tokens) - 1 and ev.finish_reason is not None:
                # the loop ended it (its caps equal the text's, so this is a safety net)
                text += job.text.end()
                finish = "stop" if ev.finish_reason == "stop" else "length"
            out = TokenOut(text, int(tok), finish)
            if job.logprobs and not (finish == "stop" and out.token in self.tokenizer.eos_token_ids):
                out.logprob, out.top = lps[(ev.uid, i)]
            if finish is not None:
                s = ev.stats
                s.generated_tokens = job.text.n
                out.usage = {"prompt_tokens": len(job.prompt_ids), "completion_tokens": job.text.n,
                             "cached_tokens": s.cached_tokens}
                out.stats = s.as_dict()
                self.metrics.add(completed=1, prompt_tokens=len(job.prompt_ids), cached_tokens=s.cached_tokens,
                                 generated_tokens=job.text.n, rounds=s.rounds, round_tokens=s.round_tokens,
                                 drafted=s.drafted, accepted=s.accepted)
                self._close(job, keep=True)
                with self.metrics.lock:  # before the last chunk: a client that reads /metrics next sees it gone
                    self.metrics.batch_size = self._batch.active
                self._post(job, out)
                return
            self._post(job, out)

    def _fail(self, job: Job, error: APIError) -> None:
        self.metrics.add(errors=1)
        self._post(job, Failed(error))  # after the events already queued for it
