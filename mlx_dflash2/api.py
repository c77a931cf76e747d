"""Python API: ``stream_generate`` and ``generate``.

Mirrors ``mlx_lm.generate``: the same response object fields, one response per
generated token, text streamed through an incremental detokenizer (which
never splits a multi-byte character). Adds exact stop strings (text held back
while it could still be the start of a stop string) and speculative decoding
statistics (:class:`~.speculative.SpecStats`) on every response.
"""

from __future__ import annotations

import numbers

import time
from dataclasses import dataclass, field
from typing import Generator, List, Optional, Sequence, Union

import mlx.core as mx

from .loading import SpeculativeModel, check_block_size, make_proposer
from .speculative import GenerationState, SpecStats, speculative_generate_step
from .sampling import SamplingParams
from .verify import Verifier, make_verifier

__all__ = ["GenerationResponse", "stream_generate", "generate", "IncrementalDetokenizer", "TextStream",
           "RequestSampling", "request_sampling"]


@dataclass
class GenerationResponse:
    """One step of :func:`stream_generate` (fields as ``mlx_lm.GenerationResponse``).

    Attributes:
        text: the next segment of decoded text (may be empty).
        token: the token id.
        logprobs: the target's log-probabilities ``[V]`` at this position.
        from_draft: the token was an accepted draft token.
        prompt_tokens: prompt length (tokens).
        prompt_tps: prefill speed (tokens/s).
        generation_tokens: tokens generated so far (the EOS included).
        generation_tps: decode speed so far (tokens/s).
        peak_memory: peak memory so far (GB).
        finish_reason: ``"stop"`` (EOS or stop string), ``"length"`` or None.
        stats: the request's :class:`SpecStats` (final on the last response).
    """

    text: str
    token: int
    logprobs: mx.array
    from_draft: bool
    prompt_tokens: int
    prompt_tps: float
    generation_tokens: int
    generation_tps: float
    peak_memory: float
    finish_reason: Optional[str] = None
    stats: SpecStats = field(default_factory=SpecStats)


@dataclass
class RequestSampling:
    """How one request samples (what :func:`request_sampling` builds from its :class:`SamplingParams`).

    Attributes:
        verifier: its own verifier (greedy or rejection sampling, its logits processors; a sampled
            one holds the request's verify key and splits it once per round).
        draft_temperature: the drafter's temperature (``params.temp``; 0: greedy drafts).
        draft_key: the drafter's own PRNG key (split once per round that drafts), None when greedy.
        adaptive: whether a timing-based adaptive schedule may choose the rounds (False for a seeded
            sampled request: it repeats token for token only if its rounds do).
    """

    verifier: Verifier
    draft_temperature: float
    draft_key: Optional[mx.array]
    adaptive: bool


def request_sampling(params: SamplingParams, kernel_mode: Optional[str] = None) -> RequestSampling:
    """A request's verifier and drafter randomness from its validated ``params``: the request's root
    key (``params.key()``: from its seed, else fresh) split into a draft key and a verify key, so its
    random streams are its own and consumed in round order, whichever loop (solo or batched) runs it.

    Args:
        params: validated sampling parameters.
        kernel_mode: the greedy accept's kernel mode (the model's ``kernels``; None: the default).
    """
    draft_key, verify_key = mx.random.split(params.key())
    return RequestSampling(
        verifier=make_verifier(params, verify_key, kernel_mode=kernel_mode),
        draft_temperature=params.temp,
        draft_key=draft_key if not params.greedy else None,
        adaptive=params.greedy or params.seed is None,
    )


class IncrementalDetokenizer:
    """Streaming text through the tokenizer's own ``decode`` over a sliding
    window of tokens (the prefix/read offsets of vLLM's and TGI's detokenizers).

    The segments concatenate to exactly ``tokenizer.decode(tokens)`` (no
    leading space lost, whatever the tokenizer family), and a segment never
    ends inside a multi-byte character: while the window's text ends in
    U+FFFD the new text is held back.
    """

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self.tokens: list[int] = []
        self._prefix = 0
        self._read = 0

    def _decode(self, toks: list[int]) -> str:
        return self.tokenizer.decode(toks)

    def add_token(self, token: int) -> str:
        """Append a token; return the new complete text (may be empty)."""
        self.tokens.append(int(token))
        before = self._decode(self.tokens[self._prefix : self._read])
        now = self._decode(self.tokens[self._prefix :])
        if len(now) > len(before) and not now.endswith("\ufffd"):
            self._prefix, self._read = self._read, len(self.tokens)
            return now[len(before) :]
        return ""

    def finalize(self) -> str:
        """Flush held-back text (an incomplete character becomes U+FFFD, as decode() does)."""
        before = self._decode(self.tokens[self._prefix : self._read])
        now = self._decode(self.tokens[self._prefix :])
        self._prefix = self._read = len(self.tokens)
        return now[len(before) :]


class TextStream:
    """The text side of one request's token stream: incremental detokenizing, stop strings, EOS and the
    length cap, token by token (what :func:`stream_generate` and the server's batched requests share).

    Args:
        tokenizer: the target's ``TokenizerWrapper`` (its ``eos_token_ids`` end the stream).
        stop: stop strings (the text ends before the first; it is never returned).
        cap: tokens at most (the last one finishes with ``"length"``); ``-1``: no cap.
    """

    def __init__(self, tokenizer, stop: Optional[Sequence[str]] = None, cap: int = -1):
        self.detok = IncrementalDetokenizer(tokenizer)
        self.stopper = _StopText(stop or ())
        self.eos = set(tokenizer.eos_token_ids)
        self.cap = cap
        self.n = 0  # tokens fed so far

    def add(self, token: int) -> tuple[str, Optional[str]]:
        """Feed the next token; returns its text segment (may be empty) and the finish reason
        (``"stop"``: EOS or a stop string, ``"length"``: the cap; None: the stream goes on)."""
        self.n += 1
        if token in self.eos:
            text, _ = self.stopper.feed(self.detok.finalize())
            return text + self.stopper.flush(), "stop"
        text, stopped = self.stopper.feed(self.detok.add_token(token))
        if stopped:
            return text, "stop"
        if self.n == self.cap:
            more, stopped = self.stopper.feed(self.detok.finalize())
            return text + (more if stopped else more + self.stopper.flush()), "stop" if stopped else "length"
        return text, None

    def end(self) -> str:
        """Flush the text held back (an unfinished character, a possible stop-string start): the
        stream was ended from outside (e.g. by the generation loop's own limit)."""
        more, _ = self.stopper.feed(self.detok.finalize())
        return more + self.stopper.flush()


class _StopText:
    """Cuts text at the first stop string, holding back any tail that could
    still begin one (so no stop text is ever streamed)."""

    def __init__(self, stops: Sequence[str]):
        self.stops = [s for s in stops if s]
        self.pending = ""

    def feed(self, segment: str) -> tuple[str, bool]:
        self.pending += segment
        if not self.stops:
            out, self.pending = self.pending, ""
            return out, False
        hits = [i for i in (self.pending.find(s) for s in self.stops) if i >= 0]
        if hits:
            out, self.pending = self.pending[: min(hits)], ""
            return out, True
        hold = 0
        for s in self.stops:
            for k in range(min(len(s) - 1, len(self.pending)), hold, -1):
                if self.pending.endswith(s[:k]):
                    hold = k
                    break
        cut = len(self.pending) - hold
        out, self.pending = self.pending[:cut], self.pending[cut:]
        return out, False

    def flush(self) -> str:
        out, self.pending = self.pending, ""
        return out


def stream_generate(
    model: SpeculativeModel,
    tokenizer,
    prompt: Union[str, mx.array, List[int]],
    max_tokens: int = 256,
    *,
    block_size: Optional[int] = None,
    drafter=None,
    temp: float = 0.0,
    top_p: float = 1.0,
    top_k: int = 0,
    min_p: float = 0.0,
    repetition_penalty: Optional[float] = None,
    repetition_context_size: int = 20,
    presence_penalty: Optional[float] = None,
    presence_context_size: int = 20,
    frequency_penalty: Optional[float] = None,
    frequency_context_size: int = 20,
    logit_bias: Optional[dict] = None,
    seed: Optional[int] = None,
    stop: Optional[Sequence[str]] = None,
    prefill_step_size: int = 2048,
    prompt_progress_callback=None,
    state: Optional[GenerationState] = None,
) -> Generator[GenerationResponse, None, None]:
    """Generate text with DFlash2 speculative decoding, one response per token.

    Args:
        model: from :func:`mlx_dflash2.load`.
        tokenizer: the target's ``TokenizerWrapper``.
        prompt: text (encoded as-is; apply a chat template first for chat
            models), token ids or an ``mx.array`` of ids.
        max_tokens: maximum generated tokens (the EOS counts; ``-1``: no limit).
        block_size: B for this request (default: the model's).
        drafter: override the model's drafter (``"none"``, ``"lookup"``, a
            :class:`~.proposers.Proposer`...).
        temp, top_p, top_k, min_p: sampling parameters (names and semantics of
            ``mlx_lm.sample_utils.make_sampler``).
        repetition_penalty, presence_penalty, frequency_penalty (and their
            ``*_context_size``), logit_bias: logits processors (names and
            semantics of ``mlx_lm.sample_utils.make_logits_processors``).
            Sampled output keeps exactly the distribution of plain sampling
            with the same parameters (rejection-sampling verification).
        seed: makes a sampled run reproducible (a per-request PRNG key; the
            global MLX random state is not touched).
        stop: stop strings; generation ends at the first, which is not returned.
        prefill_step_size: prompt chunk size (tokens).
        prompt_progress_callback: ``f(processed, total)`` during prefill.
        state: receives the request's caches (for inspection).

    Yields:
        :class:`GenerationResponse`; the last one has ``finish_reason`` set.

    Raises:
        ValueError: empty prompt, ``max_tokens`` not an integer >= 1 or -1, or an invalid sampling
            parameter (the message starts with the parameter's name).
    """
    if isinstance(max_tokens, bool) or not isinstance(max_tokens, numbers.Integral) or max_tokens == 0 \
            or max_tokens < -1:
        # as the CLI and the server: -3 was taken as "no limit", "x" a TypeError deep in the loop (a fresh user's find)
        raise ValueError(f"max_tokens must be an integer >= 1, or -1 for no limit; got {max_tokens!r}")
    params = SamplingParams(
        temp=temp,
        top_p=top_p,
        top_k=top_k,
        min_p=min_p,
        repetition_penalty=repetition_penalty,
        repetition_context_size=repetition_context_size,
        presence_penalty=presence_penalty,
        presence_context_size=presence_context_size,
        frequency_penalty=frequency_penalty,
        frequency_context_size=frequency_context_size,
        logit_bias=logit_bias,
        seed=seed,
    ).validate()
    rs = request_sampling(params, kernel_mode=getattr(model, "kernels", None))
    if isinstance(prompt, str):
        add_special = tokenizer.bos_token is None or not prompt.startswith(tokenizer.bos_token)
        prompt = tokenizer.encode(prompt, add_special_tokens=add_special)
    elif isinstance(prompt, mx.array):
        prompt = prompt.tolist()
    prompt = list(prompt)
    proposer = model.proposer
    if drafter is not None:
        # the loaded model's drafter context window and tree setting carry over (a fused proposer keeps the window
        # on its drafter part)
        loaded = getattr(model.proposer, "drafter", model.proposer)
        window = getattr(loaded, "context_window", None)
        proposer = make_proposer(drafter, model.target, tokenizer, model.name, trees=model.trees,
                                 **({} if window is None else {"drafter_window": window}))
    if block_size is not None:
        check_block_size(block_size)  # also without a drafter (where B is then 1), as the CLI refuses it
    B = block_size if block_size is not None else (
        proposer.block_size if (drafter is not None and proposer) else model.block_size
    )
    if proposer is None:
        B = 1

    stats = SpecStats()
    gen = speculative_generate_step(
        prompt,
        model.target,
        proposer,
        verifier=rs.verifier,
        block_size=B,
        draft_temperature=rs.draft_temperature,
        draft_key=rs.draft_key,
        adaptive=rs.adaptive,
        max_tokens=max_tokens,
        prefill_step_size=prefill_step_size,
        stats=stats,
        state=state,
        prompt_progress_callback=prompt_progress_callback,
    )

    def response(text, token, logprobs, from_draft, n, finish):
        return GenerationResponse(
            text=text,
            token=token,
            logprobs=logprobs,
            from_draft=from_draft,
            prompt_tokens=len(prompt),
            prompt_tps=stats.prefill_tps,
            generation_tokens=n,
            generation_tps=n / max(time.perf_counter() - tic, 1e-9),
            peak_memory=mx.get_peak_memory() / 1e9,
            finish_reason=finish,
            stats=stats,
        )

    # The loop also ends at the target's context limit: treat that like max_tokens.
    cap = max_tokens
    limit = model.target.max_context
    if limit is not None:
        room = limit - len(prompt) + 1
        cap = room if cap < 0 else min(cap, room)
    out = TextStream(tokenizer, stop, cap)
    tic = time.perf_counter()
    try:
        for token, logprobs, from_draft in gen:
            if out.n == 0:
                tic = time.perf_counter()
            text, finish = out.add(token)
            n = out.n
            if finish is not None:
                gen.close()
                yield response(text, token, logprobs, from_draft, n, finish)
                return
            yield response(text, token, logprobs, from_draft, n, None)
    finally:
        gen.close()


def generate(model: SpeculativeModel, tokenizer, prompt, verbose: bool = False, **kwargs) -> str:
    """Generate a complete response (mirrors ``mlx_lm.generate``).

    Args:
        verbose: print the text as it is generated, then the statistics.
        kwargs: passed to :func:`stream_generate`.

    Returns:
        The generated text (stop strings and EOS excluded).
    """
    return _consume(stream_generate(model, tokenizer, prompt, **kwargs), echo=verbose, show_stats=verbose)


def _consume(responses, echo: bool, show_stats: bool, return_stats: bool = False):
    """Join the responses' text, printing it (``echo``) and the statistics (``show_stats``) as it goes;
    returns the text, or ``(text, SpecStats)`` with ``return_stats``."""
    text = ""
    last = None
    for last in responses:
        if echo:
            print(last.text, end="", flush=True)
        text += last.text
    if echo:
        print()
    if show_stats and last is not None:
        print("=" * 10)
        print(last.stats.summary())
        print(f"Peak memory: {last.peak_memory:.3f} GB")
    if return_stats:
        return text, (last.stats if last is not None else SpecStats())
    return text
