"""Request and response models of the OpenAI-compatible server (pydantic v2).

The request models validate every field the server reads and give the OpenAPI
schema (``GET /openapi.json``). Field names, defaults and ranges follow
``mlx_lm.server`` and OpenAI's API; ``null`` always means "the server default"
(the ``--temp`` / ``--max-tokens`` ... flags). Unknown fields are ignored, as
OpenAI clients send fields this server has no use for (``user``, ``store`` ...);
a known field asking for what the server does not do (``n`` or ``best_of`` > 1,
``echo``, ``suffix``) is a 400 that names it.

Errors are returned in OpenAI's format (:class:`ErrorResponse`)::

    {"error": {"message": "...", "type": "invalid_request_error", "param": "max_tokens", "code": null}}
"""

from __future__ import annotations

from typing import Annotated, Any, Dict, List, Literal, Optional, Union

from pydantic import (BaseModel, BeforeValidator, ConfigDict, Field, StrictBool, StrictFloat, StrictStr, WithJsonSchema,
                      field_validator)

__all__ = [
    "APIError",
    "ChatMessage",
    "ChatCompletionRequest",
    "CompletionRequest",
    "ErrorResponse",
    "FIELD_NAMES",
]

# Template arguments a request may not override: the server sets them.
RESERVED_TEMPLATE_KWARGS = frozenset(
    {"conversation", "messages", "tokenize", "add_generation_prompt", "return_dict", "return_tensors",
     "continue_final_message", "tools", "documents", "chat_template", "padding", "truncation", "max_length",
     "return_assistant_tokens_mask", "tokenizer_kwargs"}
)


class APIError(Exception):
    """An error returned to the client in OpenAI's format.

    Args:
        status: HTTP status (400 for bad requests).
        message: human-readable message.
        param: the offending request field (``"max_tokens"``, ``"messages[0].role"``) or None.
        code: machine-readable code (``"context_length_exceeded"``, ``"model_not_found"``) or None.
        type: OpenAI error type (default from the status: ``invalid_request_error`` for 4xx).
    """

    def __init__(self, status: int, message: str, param: Optional[str] = None, code: Optional[str] = None,
                 type: Optional[str] = None):
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code
        if type is None:
            type = {404: "not_found_error", 405: "invalid_request_error"}.get(
                status, "invalid_request_error" if status < 500 else "server_error"
            )
        self.type = type

    def body(self) -> dict:
        """The JSON body: ``{"error": {message, type, param, code}}``."""
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


def bad_request(message: str, param: Optional[str] = None, code: Optional[str] = None) -> APIError:
    """A 400 ``invalid_request_error``."""
    return APIError(400, message, param, code)


def invalid_value(param: str, message: str) -> APIError:
    """A 400 naming the request field it is about, in one form for every field: ``Invalid value for 'PARAM':
    MESSAGE`` (as the request model's own validation errors read)."""
    return bad_request(f"Invalid value for '{param}': {message}", param)


# ----------------------------------------------------------------------------
# Requests
# ----------------------------------------------------------------------------

def _json_int(v):
    """JSON integers: ints and integral numbers such as ``8.0`` (JSON Schema's
    definition); strings, booleans and fractions are refused."""
    if isinstance(v, float) and v.is_integer():
        return int(v)
    if isinstance(v, bool) or not isinstance(v, int):
        raise ValueError("Input should be a valid integer")
    return v


#: An integer as JSON Schema defines it (``8`` or ``8.0``; not ``"8"``, ``true`` or ``8.5``).
StrictInt = Annotated[int, BeforeValidator(_json_int)]
#: A stop string: non-empty (the schema says so; the field's validator gives the message).
#: stop strings a request may give, and their length: the engine thread checks every emitted token of a request
#: against its stop strings, so 100,000 of them (a fresh user's find, session 25) cost ~60 ms per token to every
#: request batched with it (OpenAI allows 4; agents rarely send more than a few dozen)
MAX_STOP_STRINGS = 64
MAX_STOP_CHARS = 2048
StopString = Annotated[StrictStr, WithJsonSchema({"type": "string", "minLength": 1, "maxLength": MAX_STOP_CHARS})]
Penalty = Optional[StrictFloat]


def check_text(s: str, what: str) -> str:
    """``s`` if it is text a tokenizer can encode; a lone UTF-16 surrogate (JSON ``"\ud800"``, which Python's parser
    accepts) raises ValueError naming ``what`` and its position (it reached the tokenizer: a 500 for a completion's
    prompt, a cryptic 400 for a chat message; a fresh user's find, session 26)."""
    try:
        s.encode("utf-8")
    except UnicodeEncodeError as e:
        raise ValueError(f"{what} holds a lone surrogate (U+{ord(s[e.start]):04X}) at character {e.start}: "
                         "not valid Unicode text (encode the text as UTF-8 JSON strings)") from None
    return s


def json_kind(v) -> str:
    """The JSON type of a parsed JSON value, as a request's error message names it (``"a number"``, ``"null"``)."""
    if v is None:
        return "null"
    for t, name in ((bool, "a boolean"), ((int, float), "a number"), (str, "a string"), (list, "an array"),
                    (dict, "an object")):
        if isinstance(v, t):
            return name
    return type(v).__name__


class _Request(BaseModel):
    # non-finite numbers (JSON's Infinity / NaN, which Python's parser accepts) are refused by name
    model_config = ConfigDict(extra="ignore", allow_inf_nan=False)


class TextPart(_Request):
    """A text content part (``{"type": "text", "text": "..."}``); other part types are refused."""

    type: Literal["text"]
    text: StrictStr  # checked as text by ChatMessage (check_text, naming the part)


class ChatMessage(_Request):
    """One chat message. ``developer`` is read as ``system``; ``content`` is a string
    or a list of text parts. As OpenAI's, only an assistant message may leave it out
    (missing or ``null``: a tool-call turn; read as empty)."""

    # the schema says it too: a message of another role has non-null content
    model_config = ConfigDict(json_schema_extra={"anyOf": [
        {"properties": {"role": {"const": "assistant"}}},
        {"required": ["content"], "properties": {"content": {"not": {"type": "null"}}}},
    ]})

    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: Optional[Union[StrictStr, List[TextPart]]] = Field(None, validate_default=True)
    name: Optional[StrictStr] = None
    tool_calls: Optional[List[Dict[str, Any]]] = None
    tool_call_id: Optional[StrictStr] = None

    @field_validator("content", mode="before")
    @classmethod
    def _check_parts(cls, v):
        # a list of parts that are not all text parts: say which part and what is supported (pydantic's union error
        # was "Input should be a valid string", about the other branch; a fresh user's find, session 25)
        if isinstance(v, list):
            if not v:  # as OpenAI's: an empty array is refused (it was read as an empty message)
                raise ValueError("the content is an empty list: send a string or at least one text part "
                                 '({"type": "text", "text": "..."})')
            for j, part in enumerate(v):
                kind = part.get("type") if isinstance(part, dict) else None
                if not isinstance(part, dict):
                    raise ValueError(f'content part {j} must be an object {{"type": "text", "text": "..."}}, '
                                     f"got {type(part).__name__}")
                if kind != "text":
                    raise ValueError(f"content part {j} has type {kind!r}: only text parts "
                                     '({"type": "text", "text": "..."}) are supported; this server serves a text '
                                     "model (images, audio and files are not read)")
                if not isinstance(part.get("text"), str):
                    raise ValueError(f'content part {j} needs "text": a string')
                check_text(part["text"], f"content part {j}")
        elif isinstance(v, str):
            check_text(v, "the content")
        elif v is not None:  # pydantic's union error was "Input should be a valid string" (a fresh user's find)
            raise ValueError('the content must be a string or a list of text parts ({"type": "text", "text": "..."})'
                             f", got {json_kind(v)}")
        return v

    @field_validator("content")
    @classmethod
    def _check_content(cls, v, info):
        # a user message with null content was taken as an empty one (a fresh user's find, session 25)
        role = info.data.get("role")  # absent when the role itself is invalid (that error is reported)
        if v is None and role not in (None, "assistant"):
            raise ValueError(f"a {role} message needs content (a string or a list of text parts); "
                             "only an assistant message may leave it out or null")
        return v


class StreamOptions(_Request):
    """``stream_options``: ``include_usage`` adds a final chunk with ``usage``."""

    include_usage: Optional[StrictBool] = None


class _GenerationFields(_Request):
    """Fields shared by chat and text completions (``null`` = server default)."""

    model: Optional[StrictStr] = Field(None, description="the served model's id (see GET /v1/models); null: it")
    stream: Optional[StrictBool] = Field(None, description="stream the answer as server-sent events")
    stream_options: Optional[StreamOptions] = None
    max_tokens: Optional[StrictInt] = Field(None, ge=1, description="maximum generated tokens (default --max-tokens)")
    max_completion_tokens: Optional[StrictInt] = Field(None, ge=1, description="alias of max_tokens; wins if both")
    temperature: Optional[StrictFloat] = Field(None, ge=0, description="0: greedy (default --temp)")
    top_p: Optional[StrictFloat] = Field(None, gt=0, le=1, description="nucleus sampling, in (0, 1]")
    top_k: Optional[StrictInt] = Field(None, ge=0, description="top-k sampling (0: off)")
    min_p: Optional[StrictFloat] = Field(None, ge=0, le=1, description="min-p sampling (0: off)")
    repetition_penalty: Penalty = Field(None, ge=0, description="multiplicative penalty (0 or 1: off)")
    repetition_context_size: Optional[StrictInt] = Field(None, ge=1, le=1_000_000)
    presence_penalty: Penalty = Field(None, ge=-2, le=2)
    presence_context_size: Optional[StrictInt] = Field(None, ge=1, le=1_000_000)
    frequency_penalty: Penalty = Field(None, ge=-2, le=2)
    frequency_context_size: Optional[StrictInt] = Field(None, ge=1, le=1_000_000)
    logit_bias: Optional[Dict[StrictStr, StrictFloat]] = Field(
        None, description='token id (as a string) -> bias in [-100, 100], e.g. {"1234": -100}'
    )
    seed: Optional[StrictInt] = Field(None, description="random seed, an integer in [0, 2**64 - 1]")
    stop: Optional[Union[StopString, Annotated[List[StopString], WithJsonSchema(
        {"type": "array", "items": {"type": "string", "minLength": 1, "maxLength": MAX_STOP_CHARS},
         "maxItems": MAX_STOP_STRINGS})]]] = Field(
        None, description="stop string(s); generation ends at the first, which is not returned"
    )
    n: Optional[StrictInt] = Field(None, ge=1, le=1, description="number of choices (only 1)")
    best_of: Optional[StrictInt] = Field(None, ge=1, le=1, description="candidates generated for the one "
                                         "returned (only 1)")
    num_draft_tokens: Optional[StrictInt] = Field(
        None, ge=1, le=64, description="block size B for this request (1: no drafting; default --block-size)"
    )

    @field_validator("seed")
    @classmethod
    def _check_seed(cls, v):
        # a Field(le=2**64 - 1) prints its bound as a rounded float (18446744073709552000)
        if v is not None and not 0 <= v <= 2**64 - 1:
            raise ValueError(f"must be an integer in [0, 18446744073709551615] (2**64 - 1), got {v}")
        return v

    @field_validator("n", "best_of", mode="before")
    @classmethod
    def _check_one(cls, v, info):
        # best_of was accepted and ignored (a fresh user's find, session 25); n's message said only "<= 1".
        # Before the type check: 1, 1.0 and null go on to it (and true, which it refuses).
        if v is not None and v != 1:
            raise ValueError(f"only {info.field_name}=1 is supported (one choice per request), got {v!r}")
        return v

    @field_validator("stop", mode="before")
    @classmethod
    def _check_stop_type(cls, v):
        # before the type check: pydantic's "Input should be a valid string" hid that a list is accepted too
        # (a fresh user's find)
        if v is None or isinstance(v, str) or isinstance(v, list) and all(isinstance(x, str) for x in v):
            return v
        if isinstance(v, list):
            i = next(i for i, x in enumerate(v) if not isinstance(x, str))
            raise ValueError(f"stop must be a string or a list of strings: item {i} is {json_kind(v[i])}")
        raise ValueError(f"stop must be a string or a list of strings, got {json_kind(v)}")

    @field_validator("stop")
    @classmethod
    def _check_stop(cls, v):
        # an empty stop string was accepted and silently dropped (a fresh user's find, session 25)
        stops = [] if v is None else [v] if isinstance(v, str) else v
        if "" in stops:
            raise ValueError("stop strings must be non-empty")
        if len(stops) > MAX_STOP_STRINGS:
            raise ValueError(f"at most {MAX_STOP_STRINGS} stop strings, got {len(stops)}")
        if any(len(s) > MAX_STOP_CHARS for s in stops):
            raise ValueError(f"a stop string may have at most {MAX_STOP_CHARS} characters")
        return v

    @field_validator("logit_bias")
    @classmethod
    def _check_logit_bias(cls, v):
        if v is None:
            return v
        for k, b in v.items():
            try:
                tid = int(k)
            except ValueError:
                raise ValueError(f"keys must be token ids (integers as strings), got {k!r}") from None
            if tid < 0:
                raise ValueError(f"token id {tid} is negative")
            if not -100 <= b <= 100:
                raise ValueError(f"bias {b} for token {k} is outside [-100, 100]")
        return v

    def stop_list(self) -> list[str]:
        if self.stop is None:
            return []
        return [self.stop] if isinstance(self.stop, str) else list(self.stop)

    def requested_max_tokens(self) -> Optional[int]:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens


class ChatCompletionRequest(_GenerationFields):
    """``POST /v1/chat/completions``."""

    messages: List[ChatMessage] = Field(..., min_length=1)
    logprobs: Optional[StrictBool] = Field(None, description="return the log-probability of each output token")
    top_logprobs: Optional[StrictInt] = Field(None, ge=0, le=20, description="alternatives per token (needs logprobs)")
    chat_template_kwargs: Optional[Dict[str, Any]] = Field(
        None, description='extra chat template arguments, e.g. {"enable_thinking": false}'
    )
    tools: Optional[List[Dict[str, Any]]] = Field(None, description="passed to the chat template")

    @field_validator("chat_template_kwargs")
    @classmethod
    def _check_template_kwargs(cls, v):
        if v:
            bad = sorted(RESERVED_TEMPLATE_KWARGS & set(v))
            if bad:
                raise ValueError(f"{', '.join(bad)} cannot be set through chat_template_kwargs")
        return v


class CompletionRequest(_GenerationFields):
    """``POST /v1/completions``: ``prompt`` is a string, a list of one string, or token ids."""

    prompt: Union[StrictStr, List[StrictInt], List[StrictStr]]
    logprobs: Optional[StrictInt] = Field(None, ge=0, le=20, description="top log-probabilities per token")
    echo: Optional[StrictBool] = Field(None, description="only false is supported")
    suffix: Optional[StrictStr] = Field(None, description="only null is supported")

    @field_validator("prompt", mode="before")
    @classmethod
    def _check_prompt_type(cls, v):
        # pydantic's union error was "Input should be a valid string" for a number, a list of lists (OpenAI's batch
        # of token-id prompts) or a list mixing ids and strings (a fresh user's find); say what is accepted
        accepted = "the prompt must be a string, a list of one string, or a list of token ids (integers)"
        if not isinstance(v, list):
            if isinstance(v, str):
                return v  # its text is checked below
            raise ValueError(f"{accepted}, got {json_kind(v)}")
        if any(isinstance(x, list) for x in v):
            raise ValueError(f"{accepted}, got a list of lists (a batch of prompts): send one prompt per request, "
                             "its token ids as one flat list")
        strings = sum(isinstance(x, str) for x in v)
        if strings == len(v):
            return v  # one string, none ("the prompt is empty") or several ("only one prompt") are checked below
        if strings:
            raise ValueError(f"{accepted}, got a list mixing strings and other values")
        for j, x in enumerate(v):
            if isinstance(x, bool) or not (isinstance(x, int) or isinstance(x, float) and x.is_integer()):
                got = x if isinstance(x, float) else json_kind(x)
                raise ValueError(f"{accepted}; item {j} is {got}, not a token id (an integer)")
        return v

    @field_validator("prompt")
    @classmethod
    def _check_prompt(cls, v):
        if isinstance(v, list):
            if not v:
                raise ValueError("the prompt is empty")
            if isinstance(v[0], str) and len(v) != 1:
                raise ValueError("only one prompt per request is supported")
        for text in [v] if isinstance(v, str) else [x for x in v if isinstance(x, str)]:
            check_text(text, "the prompt")
        return v


# ----------------------------------------------------------------------------
# Responses (documentation of the OpenAPI schema; handlers build plain dicts)
# ----------------------------------------------------------------------------


class ErrorDetail(BaseModel):
    message: str
    type: str
    param: Optional[str] = None
    code: Optional[str] = None


class ErrorResponse(BaseModel):
    """OpenAI's error body."""

    error: ErrorDetail


class PromptTokensDetails(BaseModel):
    cached_tokens: int


class CompletionTokensDetails(BaseModel):
    reasoning_tokens: int = Field(
        description="generated tokens of thinking blocks (reasoning_content), markers included; part of "
        "completion_tokens (0 without a thinking model and for text completions)")


class Usage(BaseModel):
    """Token counts; ``prompt_tokens_details.cached_tokens`` came from the prompt cache,
    ``completion_tokens_details.reasoning_tokens`` are the thinking part of ``completion_tokens``."""

    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails
    completion_tokens_details: CompletionTokensDetails


class SpeculativeStats(BaseModel):
    """Per-response speculative decoding figures (an extension of OpenAI's format)."""

    drafter: str
    block_size: int
    draft_confidence: float = Field(0.0, description="the drafter's dynamic draft length threshold (0: full blocks)")
    draft_vocab: int = Field(0, description="ids the drafter proposes from, with a draft vocabulary (0: all)")
    acceptance_length: float = Field(description="tau: tokens emitted per target forward (verify round)")
    rounds: int
    rounds_by_source: dict[str, int] = Field(
        default_factory=dict, description="rounds by what made their draft: drafter, lookup, none (no draft)")
    drafted_tokens: int
    accepted_tokens: int
    acceptance_rate: float
    prefill_tokens_per_second: float
    decode_tokens_per_second: float


class ChatChoiceMessage(BaseModel):
    role: Literal["assistant"]
    content: Optional[str]
    reasoning_content: Optional[str] = None


class ChatChoice(BaseModel):
    index: int
    message: ChatChoiceMessage
    logprobs: Optional[Dict[str, Any]] = None
    finish_reason: Optional[str]


class ChatCompletionResponse(BaseModel):
    """A non-streamed chat completion (streamed: ``chat.completion.chunk`` SSE events, then ``[DONE]``)."""

    id: str
    object: Literal["chat.completion"]
    created: int
    model: str
    system_fingerprint: str
    choices: List[ChatChoice]
    usage: Usage
    speculative: SpeculativeStats


class CompletionChoice(BaseModel):
    index: int
    text: str
    logprobs: Optional[Dict[str, Any]] = None
    finish_reason: Optional[str]


class CompletionResponse(BaseModel):
    """A non-streamed text completion."""

    id: str
    object: Literal["text_completion"]
    created: int
    model: str
    system_fingerprint: str
    choices: List[CompletionChoice]
    usage: Usage
    speculative: SpeculativeStats


class ModelCard(BaseModel):
    id: str
    object: Literal["model"]
    created: int
    owned_by: str


class ModelList(BaseModel):
    object: Literal["list"]
    data: List[ModelCard]


class Health(BaseModel):
    status: Literal["ok", "unavailable"]


def _field_names(*models) -> frozenset:
    names = set()
    for m in models:
        names.update(m.model_fields)
    return frozenset(names | {"format"})


#: Request field names (to name the offending field in validation errors).
FIELD_NAMES = _field_names(ChatCompletionRequest, CompletionRequest, ChatMessage, TextPart, StreamOptions)
