"""Text helpers of the server: reasoning/content split, token bytes, log-probabilities.

Pure Python except :func:`top_logprobs` and :func:`top_logprobs_many`, which read ``mx.array`` s and must
run on the generation worker's thread.
"""

from __future__ import annotations

from typing import Optional

__all__ = ["ReasoningSplitter", "initial_reasoning_state", "TokenText", "convert_chat"]


class ReasoningSplitter:
    """Routes streamed text between thinking markers to ``reasoning``, the rest to ``content``.

    Works on decoded text (like mlx-lm's ``TextStateMachine``), so it does not
    matter how the markers were tokenized. A tail that could be the start of
    the next marker is held back until it is decided; the markers themselves are
    never returned. Feeding the same text in any segmentation gives the same
    concatenated output, so streamed and non-streamed answers (and answers with
    and without a drafter) are identical.

    Args:
        think_start, think_end: the markers (``"<think>"``, ``"</think>"``);
            ``None``: no thinking, everything is content.
        reasoning: start inside a thinking block (the prompt opened it).
    """

    def __init__(self, think_start: Optional[str] = None, think_end: Optional[str] = None, reasoning: bool = False):
        self.markers = (think_start, think_end) if think_start and think_end else None
        self.reasoning = bool(reasoning and self.markers)
        self.pending = ""

    def feed(self, text: str) -> list[tuple[str, str]]:
        """Consume ``text``; returns ``[(kind, text)]`` with kind ``"reasoning"`` or ``"content"``
        (adjacent pieces of one kind merged, empty pieces dropped)."""
        if self.markers is None:
            return [("content", text)] if text else []
        out: list[tuple[str, str]] = []
        buf = self.pending + text
        while True:
            marker = self.markers[1] if self.reasoning else self.markers[0]
            i = buf.find(marker)
            if i >= 0:
                self._emit(out, buf[:i])
                buf = buf[i + len(marker):]
                self.reasoning = not self.reasoning
                continue
            hold = 0
            for k in range(min(len(marker) - 1, len(buf)), 0, -1):
                if buf.endswith(marker[:k]):
                    hold = k
                    break
            self._emit(out, buf[: len(buf) - hold])
            self.pending = buf[len(buf) - hold:]
            return out

    def feed_token(self, text: str) -> tuple[list[tuple[str, str]], bool]:
        """:meth:`feed` one generated token's text; also say whether the token is a
        *reasoning token*: one generated while a thinking block is open, from the
        token that completes the start marker through the one that completes the
        end marker (markers split over several tokens count from their last
        piece; a block opened by the prompt counts from the first token).

        Returns:
            ``(segments, is_reasoning)``.
        """
        before = self.reasoning
        segs = self.feed(text)
        return segs, bool(self.markers) and (before or self.reasoning)

    def flush(self) -> list[tuple[str, str]]:
        """Release the held-back tail (end of generation)."""
        out: list[tuple[str, str]] = []
        self._emit(out, self.pending)
        self.pending = ""
        return out

    def _emit(self, out: list, text: str) -> None:
        if not text:
            return
        kind = "reasoning" if self.reasoning else "content"
        if out and out[-1][0] == kind:
            out[-1] = (kind, out[-1][1] + text)
        else:
            out.append((kind, text))


def initial_reasoning_state(tokenizer, prompt_ids: list[int]) -> bool:
    """True when the prompt ends inside an open thinking block (e.g. a template
    that appends ``<think>`` to the generation prompt)."""
    if not getattr(tokenizer, "has_thinking", False):
        return False
    if getattr(tokenizer, "response_initial_state", None) == "reasoning":
        return True
    rs, re_ = getattr(tokenizer, "rfind_think_start", None), getattr(tokenizer, "rfind_think_end", None)
    if rs is not None and re_ is not None:
        return rs(prompt_ids) > re_(prompt_ids)
    tail = tokenizer.decode(prompt_ids[-64:])
    return tail.rfind(tokenizer.think_start) > tail.rfind(tokenizer.think_end)


class TokenText:
    """Token id -> raw bytes and display text (for log-probabilities).

    Byte-level BPE tokens are mapped to their exact bytes through mlx-lm's
    detokenizer token map; other tokenizers fall back to ``decode([id])``.
    """

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self.tokenmap = None
        self.byte_decoder = None
        try:
            from mlx_lm.tokenizer_utils import BPEStreamingDetokenizer, _byte_decoder

            detok = tokenizer._detokenizer
            if isinstance(detok, BPEStreamingDetokenizer):
                self.tokenmap = detok.tokenmap
                self.byte_decoder = _byte_decoder()
        except Exception:  # noqa: BLE001 - any mlx-lm layout change: fall back to decode
            self.tokenmap = None

    def bytes(self, token: int) -> bytes:
        """The token's bytes (may be part of a multi-byte character)."""
        if self.tokenmap is not None and 0 <= token < len(self.tokenmap):
            piece = self.tokenmap[token]
            try:
                return bytes(self.byte_decoder[c] for c in piece)
            except (KeyError, TypeError):
                pass
        return self.tokenizer.decode([token]).encode("utf-8")

    def text(self, token: int) -> str:
        """Display text of the token (invalid UTF-8 as U+FFFD)."""
        return self.bytes(token).decode("utf-8", errors="replace")


def top_logprobs(logprobs, token: int, top_n: int) -> tuple[float, list[tuple[int, float]]]:
    """The token's log-probability and the ``top_n`` best alternatives.

    Args:
        logprobs: ``mx.array`` ``[V]`` of log-probabilities (worker thread only).
        token: the emitted token id.
        top_n: alternatives wanted (0: none).

    Returns:
        ``(logprob, [(id, logprob), ...])`` sorted by decreasing log-probability.
    """
    return top_logprobs_many([(logprobs, token, top_n)])[0]


def top_logprobs_many(items: list) -> list[tuple[float, list[tuple[int, float]]]]:
    """:func:`top_logprobs` of each ``(logprobs, token, top_n)`` of ``items``, every one's ops as alone, evaluated
    together and read from evaluated arrays: one evaluation for a whole batched step's tokens, not three per token
    (a scalar's ``.item()`` and two ``.tolist()`` of new ops each evaluate on their own and release the GIL: session
    48). Returns the ``(logprob, [(id, logprob), ...])`` pairs in ``items``' order."""
    import mlx.core as mx

    built = []
    for logprobs, token, top_n in items:
        lp = logprobs[token]
        top_n = min(top_n, logprobs.shape[-1])
        if top_n > 0:
            idx = mx.argpartition(-logprobs, kth=top_n - 1)[:top_n]
            built.append((lp, idx, logprobs[idx]))
        else:
            built.append((lp, None, None))
    mx.eval([a for b in built for a in b if a is not None])
    out = []
    for lp, idx, vals in built:
        pairs = [] if idx is None else sorted(zip(idx.tolist(), vals.tolist()), key=lambda p: -p[1])
        out.append((float(lp.item()), [(int(i), float(v)) for i, v in pairs]))
    return out


def convert_chat(messages: list[dict]) -> str:
    """Plain-text prompt for tokenizers without a chat template (as ``mlx_lm.server``)."""
    prefix = {"system": "ASSISTANT's RULE: ", "user": "USER: ", "assistant": "ASSISTANT: ", "tool": "TOOL: "}
    prompt = "A chat between a curious user and an artificial intelligence assistant. " \
             "The assistant follows the given rules no matter what.\n"
    for m in messages:
        prompt += f"{prefix.get(m['role'], '')}{m.get('content') or ''}\n"
    return (prompt + prefix["assistant"]).rstrip()
