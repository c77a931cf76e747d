"""The OpenAI-compatible server: live on 127.0.0.1, driven by the official ``openai`` client and httpx.

The servers run in-process (uvicorn in a thread) on the real embedded
SmolLM2-135M target (dense float32) with lookup drafting; every request uses a
few tokens only. Heavier variants (the 8 x 5 load test, long schema fuzzing)
are marked ``slow``.
"""

from __future__ import annotations

import json
import os
import random
import socket
import statistics
import signal
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import openai
import pytest
import uvicorn

from mlx_dflash2.loading import SpeculativeModel, make_proposer
from mlx_dflash2.server.app import ServerSettings, create_app
from mlx_dflash2.server.engine import Engine, EngineConfig
from mlx_dflash2.server.text import ReasoningSplitter, initial_reasoning_state

MODEL_ID = "smollm2-135m-instruct"
MAX_CONTEXT = 512
UNICODE_PROMPT = "Translate to French, then add an emoji: \"I love coffee and crème brûlée.\" 😀 日本語"


class LiveServer:
    """A uvicorn server in a thread on a free loopback port."""

    def __init__(self, app):
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(("127.0.0.1", 0))
        self.port = sock.getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"
        self.app = app
        self.server = uvicorn.Server(uvicorn.Config(app, log_level="warning", timeout_graceful_shutdown=2))
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [sock]}, daemon=True)
        self.thread.start()
        deadline = time.time() + 30
        while not self.server.started:
            if time.time() > deadline or not self.thread.is_alive():
                raise RuntimeError("server did not start")
            time.sleep(0.02)
        self.engine: Engine = app.state.engine

    def stop(self):
        self.server.should_exit = True
        self.thread.join(10)


def make_server(target, tokenizer, proposer="lookup", engine_kw=None, settings_kw=None, tokenizer_proxy=None):
    p = make_proposer(proposer, target, tokenizer, MODEL_ID)
    model = SpeculativeModel(target, p, p.block_size if p else 1, MODEL_ID, target.config)
    engine = Engine(model, tokenizer_proxy or tokenizer,
                    EngineConfig(**{"max_context": MAX_CONTEXT, "prefill_step_size": 64, **(engine_kw or {})}))
    settings = ServerSettings(**{"model_id": MODEL_ID, "max_tokens": 16, **(settings_kw or {})})
    return LiveServer(create_app(engine, settings))


@pytest.fixture(scope="module")
def srv(smol_f32):
    target, tokenizer = smol_f32
    s = make_server(target, tokenizer)
    yield s
    s.stop()


@pytest.fixture(scope="module")
def client(srv):
    return openai.OpenAI(base_url=f"{srv.url}/v1", api_key="not-needed", max_retries=0, timeout=120)


@pytest.fixture()
def http(srv):
    with httpx.Client(base_url=srv.url, timeout=120) as c:
        yield c


def chat_msgs(text):
    return [{"role": "user", "content": text}]


def stream_chat(client, **kw):
    """Concatenated content / reasoning deltas, finish_reason, the usage chunk."""
    content, reasoning, finish, usage, spec = "", "", None, None, None
    for ch in client.chat.completions.create(stream=True, **kw):
        if ch.usage is not None:
            usage = ch.usage
        for c in ch.choices:
            content += c.delta.content or ""
            reasoning += (c.delta.model_extra or {}).get("reasoning_content") or ""
            finish = c.finish_reason or finish
        spec = (ch.model_extra or {}).get("speculative") or spec
    return content, reasoning, finish, usage, spec


def metrics(http):
    return http.get("/metrics", params={"format": "json"}).json()


# ----------------------------------------------------------------------------
# Surface
# ----------------------------------------------------------------------------



def _wait_for_cancel(http, before: dict, timeout: float = 20.0) -> dict:
    """The server's metrics once a cancellation past ``before`` is counted and no request is active (or
    after ``timeout`` seconds: the caller's asserts then say what is missing)."""
    deadline = time.time() + timeout
    while True:
        m = metrics(http)
        done = m["requests_cancelled_total"] > before["requests_cancelled_total"] and m["requests_active"] == 0
        if done or time.time() >= deadline:
            return m
        time.sleep(0.05)

def test_health_models_openapi_metrics(srv, http, client):
    assert http.get("/health").json() == {"status": "ok"}
    assert [m.id for m in client.models.list().data] == [MODEL_ID]
    assert http.get(f"/v1/models/{MODEL_ID}").json()["id"] == MODEL_ID
    spec = http.get("/openapi.json").json()
    for path in ("/v1/chat/completions", "/v1/completions", "/v1/models", "/health", "/metrics"):
        assert path in spec["paths"], path
    props = spec["components"]["schemas"]["ChatCompletionRequest"]["properties"]
    for f in ("messages", "max_tokens", "max_completion_tokens", "temperature", "top_p", "top_k", "min_p",
              "stop", "logprobs", "top_logprobs", "seed", "logit_bias", "stream_options", "chat_template_kwargs"):
        assert f in props, f
    m = metrics(http)
    for k in ("requests_total", "request_errors_total", "acceptance_length", "generation_tokens_per_second",
              "requests_active", "generated_tokens_total"):
        assert k in m
    text = http.get("/metrics").text
    assert "mlx_dflash2_acceptance_length" in text and "# TYPE mlx_dflash2_requests_total counter" in text
    r = http.get("/nope")
    assert r.status_code == 404 and r.json()["error"]["type"] == "not_found_error"


def test_chat_streamed_equals_non_streamed(client):
    for text in ("What is the capital of France?", UNICODE_PROMPT):
        kw = dict(model=MODEL_ID, messages=chat_msgs(text), max_tokens=14)
        full = client.chat.completions.create(**kw)
        ch = full.choices[0]
        assert ch.message.role == "assistant" and ch.message.content
        assert ch.finish_reason in ("stop", "length")
        assert full.usage.completion_tokens <= 14 and full.usage.prompt_tokens > 10
        assert full.usage.total_tokens == full.usage.prompt_tokens + full.usage.completion_tokens
        spec = full.model_extra["speculative"]
        assert spec["drafter"] == "lookup" and spec["acceptance_length"] >= 1.0
        assert sum(spec["rounds_by_source"].values()) == spec["rounds"]  # each round counted by its draft source
        assert set(spec["rounds_by_source"]) <= {"lookup", "none"}
        content, reasoning, finish, usage, sspec = stream_chat(client, stream_options={"include_usage": True}, **kw)
        assert content.encode() == ch.message.content.encode()
        assert reasoning == "" and finish == ch.finish_reason
        assert usage.completion_tokens == full.usage.completion_tokens
        assert usage.prompt_tokens_details.cached_tokens >= 0 and sspec["rounds"] >= 1


def test_completions_streamed_equals_non_streamed_unicode(client):
    prompts = [UNICODE_PROMPT, "日本の首都は東京です。大阪は", "Emoji list: 😀 😃 😄 😁 😆 😅 🤣 😂 🙂 🙃 😉 😊 😇 🥰"]
    outs = []
    for p in prompts:
        full = client.completions.create(model=MODEL_ID, prompt=p, max_tokens=10)
        text = full.choices[0].text
        chunks = list(client.completions.create(model=MODEL_ID, prompt=p, max_tokens=10, stream=True))
        streamed = "".join(c.choices[0].text for c in chunks if c.choices)
        assert streamed.encode("utf-8") == text.encode("utf-8")
        assert chunks[-1].choices[0].finish_reason == full.choices[0].finish_reason
        outs.append(text)
    assert any(any(ord(c) > 0x2000 for c in t) for t in outs), outs  # the test did exercise multi-byte text


FRUITS = "Name five fruits, separated by commas."  # SmolLM2 answers "1. Bananas\n2. Apples\n3. ..."


def test_stop_strings_and_max_tokens(client):
    kw = dict(model=MODEL_ID, messages=chat_msgs(FRUITS))
    free = client.chat.completions.create(max_tokens=20, **kw).choices[0]
    text = free.message.content
    assert free.finish_reason == "length" and len(text) > 20
    stop = text[len(text) // 2: len(text) // 2 + 4]
    cut = client.chat.completions.create(max_tokens=20, stop=[stop, "zzz"], **kw).choices[0]
    assert cut.finish_reason == "stop" and stop not in cut.message.content
    assert cut.message.content == text[: text.index(stop)]
    single = client.chat.completions.create(max_tokens=20, stop=stop, **kw).choices[0]
    assert single.message.content == cut.message.content
    streamed, _, finish, _, _ = stream_chat(client, max_tokens=20, stop=[stop], **kw)
    assert streamed == cut.message.content and finish == "stop"
    for n in (1, 3):
        r = client.chat.completions.create(max_tokens=n, **kw)
        assert r.usage.completion_tokens == n and r.choices[0].finish_reason == "length"
    r = client.chat.completions.create(max_completion_tokens=2, max_tokens=9, **kw)
    assert r.usage.completion_tokens == 2


def test_logprobs(client):
    kw = dict(model=MODEL_ID, messages=chat_msgs("Name three colors."), max_tokens=6)
    r = client.chat.completions.create(logprobs=True, top_logprobs=3, **kw)
    ch = r.choices[0]
    lps = ch.logprobs.content
    assert len(lps) == r.usage.completion_tokens - (1 if ch.finish_reason == "stop" else 0)
    for e in lps:
        assert e.logprob <= 0 and len(e.top_logprobs) == 3
        tops = [t.logprob for t in e.top_logprobs]
        assert tops == sorted(tops, reverse=True)
        assert abs(e.logprob - tops[0]) < 1e-5  # greedy: the chosen token is the most likely one
        assert e.token == e.top_logprobs[0].token
    if ch.finish_reason == "length":
        assert b"".join(bytes(e.bytes) for e in lps).decode() == ch.message.content
    plain = client.chat.completions.create(**kw).choices[0]
    assert plain.logprobs is None and plain.message.content == ch.message.content
    streamed = [c for c in client.chat.completions.create(stream=True, logprobs=True, **kw)
                if c.choices and c.choices[0].logprobs]
    assert [e.token for c in streamed for e in c.choices[0].logprobs.content] == [e.token for e in lps]
    t = client.completions.create(model=MODEL_ID, prompt="The sky is", max_tokens=4, logprobs=2)
    lp = t.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset) == 4
    assert all(len(d) <= 2 for d in lp.top_logprobs) and lp.text_offset[0] == 0
    assert "".join(lp.tokens) == t.choices[0].text  # the leading space of the continuation is kept


def test_sampling_parameters_are_validated_and_passed(client, http):
    kw = dict(model=MODEL_ID, messages=chat_msgs("Hi"), max_tokens=3)
    greedy = client.chat.completions.create(**kw).choices[0].message.content
    # explicit defaults and nulls mean the defaults: greedy
    same = http.post("/v1/chat/completions", json={**kw, "temperature": 0, "top_p": 1, "top_k": 0, "min_p": 0,
                                                    "seed": 7, "stop": None, "max_tokens": None,
                                                    "max_completion_tokens": 3, "presence_penalty": None,
                                                    "chat_template_kwargs": None, "stream_options": None})
    assert same.status_code == 200, same.text
    assert same.json()["choices"][0]["message"]["content"] == greedy
    # sampling and processors go through the lossless speculative path
    for extra in ({"temperature": 0.7, "top_p": 0.9, "top_k": 20, "min_p": 0.05, "seed": 1},
                  {"repetition_penalty": 1.3}, {"presence_penalty": 0.5}, {"frequency_penalty": 0.5},
                  {"logit_bias": {"42": -100}}):
        r = http.post("/v1/chat/completions", json={**kw, **extra})
        assert r.status_code == 200, r.text
        assert r.json()["usage"]["completion_tokens"] <= 3
    # a seeded sampled request is reproducible; a strong logit bias forces its token
    sk = {**kw, "temperature": 1.0, "seed": 11, "max_tokens": 8}
    a = http.post("/v1/chat/completions", json=sk).json()["choices"][0]["message"]["content"]
    assert a == http.post("/v1/chat/completions", json=sk).json()["choices"][0]["message"]["content"]
    tok_id = 330
    forced = http.post("/v1/completions", json={"prompt": "Hi", "max_tokens": 2, "logit_bias": {str(tok_id): 100},
                                                 "logprobs": 1}).json()
    assert forced["choices"][0]["logprobs"]["tokens"][0] == forced["choices"][0]["logprobs"]["tokens"][1]
    assert http.get("/health").json()["status"] == "ok"


BAD = [
    ({"max_tokens": -1}, "max_tokens"),
    ({"max_tokens": 0}, "max_tokens"),
    ({"max_tokens": 2.5}, "max_tokens"),
    ({"max_tokens": True}, "max_tokens"),
    ({"max_tokens": "8"}, "max_tokens"),
    ({"max_completion_tokens": 0}, "max_completion_tokens"),
    ({"messages": []}, "messages"),
    ({"messages": "hi"}, "messages"),
    ({"messages": [{"role": "wizard", "content": "hi"}]}, "messages[0].role"),
    ({"messages": [{"role": "user", "content": 5}]}, "messages[0].content"),
    ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]},
     "messages[0].content"),
    ({"temperature": -0.1}, "temperature"),
    ({"temperature": "hot"}, "temperature"),
    ({"top_p": 0}, "top_p"),
    ({"top_p": 1.5}, "top_p"),
    ({"top_k": -1}, "top_k"),
    ({"min_p": 2}, "min_p"),
    ({"stop": 5}, "stop"),
    ({"stop": ["ok", 3]}, "stop"),
    # a fresh user's finds (session 25): accepted and silently ignored
    ({"stop": [""]}, "stop"),
    ({"stop": ""}, "stop"),
    ({"stop": ["ok", ""]}, "stop"),
    ({"messages": [{"role": "user", "content": None}]}, "messages[0].content"),
    ({"messages": [{"role": "user"}]}, "messages[0].content"),
    ({"messages": [{"role": "user", "content": []}]}, "messages[0].content"),  # session 27's find: was accepted
    ({"messages": [{"role": "system", "content": None}, {"role": "user", "content": "Hi"}]}, "messages[0].content"),
    ({"messages": [{"role": "user", "content": "Hi"}, {"role": "tool", "content": None}]}, "messages[1].content"),
    ({"best_of": 2}, "best_of"),
    ({"stream": "yes"}, "stream"),
    ({"logprobs": "yes"}, "logprobs"),
    ({"top_logprobs": 50, "logprobs": True}, "top_logprobs"),
    ({"top_logprobs": 2}, "top_logprobs"),
    ({"n": 2}, "n"),
    ({"seed": -1}, "seed"),
    ({"seed": 2**64}, "seed"),
    ({"repetition_context_size": 0}, "repetition_context_size"),
    ({"frequency_context_size": 0}, "frequency_context_size"),
    ({"temperature": float("inf")}, "temperature"),
    ({"top_p": float("nan")}, "top_p"),
    ({"repetition_penalty": float("inf")}, "repetition_penalty"),
    ({"logit_bias": {"abc": 1}}, "logit_bias"),
    ({"logit_bias": {"5": 1000}}, "logit_bias"),
    ({"logit_bias": {"99999999": 1}}, "logit_bias"),
    ({"presence_penalty": 3}, "presence_penalty"),
    ({"chat_template_kwargs": {"tokenize": False}}, "chat_template_kwargs"),
    ({"stream_options": {"include_usage": "yes"}}, "stream_options.include_usage"),
    ({"num_draft_tokens": 0}, "num_draft_tokens"),
    ({"top_k": 10**6}, "top_k"),  # past the vocabulary: checked by the app, worded as the model's own checks
]


@pytest.mark.parametrize("patch,param", BAD, ids=[p for _, p in BAD])
def test_bad_payloads_get_400_then_server_works(http, patch, param):
    body = {"model": MODEL_ID, "messages": chat_msgs("Hi"), "max_tokens": 2, **patch}
    for stream in (False, True):
        r = http.post("/v1/chat/completions", content=json.dumps({**body, "stream": patch.get("stream", stream)}),
                      headers={"content-type": "application/json"})  # json.dumps writes Infinity / NaN as JS does
        assert r.status_code == 400, r.text
        err = r.json()["error"]
        assert err["type"] == "invalid_request_error" and err["param"] == param, err
        assert err["message"] and "Value error," not in err["message"]
        assert err["message"].startswith(f"Invalid value for '{param.split('[')[0].split('.')[0]}"), err
    ok = http.post("/v1/chat/completions", json={"messages": chat_msgs("Hi"), "max_tokens": 1})
    assert ok.status_code == 200 and ok.json()["usage"]["completion_tokens"] == 1


def test_bad_payload_messages_name_what_to_send(http):
    """A fresh user's run: a JSON body sent as text/plain was "not a JSON object", Infinity was reported as
    the internal name ``temp``, the seed's bound printed as a rounded float; each now says what to send."""
    body = {"messages": chat_msgs("Hi"), "max_tokens": 2}
    r = http.post("/v1/chat/completions", content=json.dumps(body), headers={"content-type": "text/plain"})
    assert r.status_code == 400 and "Content-Type: application/json" in r.json()["error"]["message"], r.text
    r = http.post("/v1/chat/completions", content=json.dumps({**body, "temperature": float("inf")}),
                  headers={"content-type": "application/json"})
    assert r.status_code == 400 and "finite" in r.json()["error"]["message"] and "temp:" not in r.text
    r = http.post("/v1/chat/completions", json={**body, "seed": 2**64})
    assert "18446744073709551615" in r.json()["error"]["message"]
    assert http.post("/v1/chat/completions", json={**body, "seed": 2**64 - 1}).status_code == 200


def test_unsupported_values_are_named_and_openai_defaults_accepted(http):
    """A fresh user's finds (session 25): best_of was ignored, an empty stop string and a user message with null
    content were accepted; each is a 400 that says what to send. n=1, best_of=1 and an assistant message with
    null content (OpenAI's tool-call turn) are fine."""
    body = {"messages": chat_msgs("Hi"), "max_tokens": 1}
    for path, b in (("/v1/chat/completions", body), ("/v1/completions", {"prompt": "Hi", "max_tokens": 1})):
        for field in ("n", "best_of"):
            r = http.post(path, json={**b, field: 2})
            assert r.status_code == 400 and f"only {field}=1 is supported" in r.json()["error"]["message"], r.text
            assert http.post(path, json={**b, field: 1}).status_code == 200
            r = http.post(path, json={**b, field: "1"})  # the value as sent: "got 1" contradicted "only 1"
            assert r.status_code == 400 and "got '1'" in r.json()["error"]["message"], r.text
        r = http.post(path, json={**b, "stop": ["ok", ""]})
        assert r.status_code == 400 and "stop strings must be non-empty" in r.json()["error"]["message"], r.text
        # 100,000 stop strings cost every batched request ~60 ms per token (checked on the engine thread)
        for stop, msg in (([f"s{i}" for i in range(65)], "at most 64 stop strings, got 65"),
                          (["x" * 2049], "at most 2048 characters")):
            r = http.post(path, json={**b, "stop": stop})
            assert r.status_code == 400 and msg in r.json()["error"]["message"], r.text
            assert r.json()["error"]["param"] == "stop"
        assert http.post(path, json={**b, "stop": [f"s{i}" for i in range(64)]}).status_code == 200
    r = http.post("/v1/chat/completions", json={**body, "messages": [{"role": "user", "content": None}]})
    assert r.status_code == 400, r.text
    assert "a user message needs content" in r.json()["error"]["message"]
    # content parts other than text ones: which part and what is supported (was "Input should be a valid string")
    for parts, msg in (([{"type": "text", "text": "Hi"}, {"type": "image_url", "image_url": {"url": "x"}}],
                        "content part 1 has type 'image_url': only text parts"),
                       ([{"type": "text"}], 'content part 0 needs "text": a string'),
                       (["Hi"], "content part 0 must be an object")):
        r = http.post("/v1/chat/completions", json={**body, "messages": [{"role": "user", "content": parts}]})
        assert r.status_code == 400 and msg in r.json()["error"]["message"], r.text
        assert r.json()["error"]["param"] == "messages[0].content"
    # a lone surrogate ("\ud800" in the JSON) reached the tokenizer: a 500 for a prompt (session 26)
    for path, b, param in (("/v1/completions", {"prompt": "Hi \ud800"}, "prompt"),
                           ("/v1/completions", {"prompt": ["\udfff"]}, "prompt"),
                           ("/v1/chat/completions", {"messages": [{"role": "user", "content": "a\ud800"}]},
                            "messages[0].content"),
                           ("/v1/chat/completions", {"messages": [{"role": "user", "content": [
                               {"type": "text", "text": "\ud800"}]}]}, "messages[0].content")):
        r = http.post(path, content=json.dumps({**b, "max_tokens": 1}), headers={"content-type": "application/json"})
        assert r.status_code == 400 and "lone surrogate (U+D" in r.json()["error"]["message"], r.text
        assert r.json()["error"]["param"] == param, r.text
    ok = [{"type": "text", "text": "Hi"}, {"type": "text", "text": " there"}]
    assert http.post("/v1/chat/completions", json={**body, "messages": [{"role": "user", "content": ok}]}
                     ).status_code == 200
    call = {"id": "call_1", "type": "function", "function": {"name": "f", "arguments": "{}"}}
    turns = chat_msgs("Hi") + [{"role": "assistant", "content": None, "tool_calls": [call]},
                               {"role": "tool", "tool_call_id": "call_1", "content": "42"},
                               {"role": "user", "content": "And?"}]
    r = http.post("/v1/chat/completions", json={**body, "messages": turns})
    assert r.status_code == 200, r.text
    for bad in ("JSON", "", "xml"):  # a query parameter's error names it (it blamed a missing JSON body)
        r = http.get("/metrics", params={"format": bad})
        assert r.status_code == 400 and r.json()["error"]["param"] == "format", r.text
        assert "Invalid value for 'format'" in r.json()["error"]["message"], r.text


def test_wrong_content_and_prompt_types_say_what_is_accepted(http):
    """A fresh user's finds: a message's content 5 and a prompt [[1, 2], [3]] (OpenAI's batch form) were 400s saying
    only pydantic's "Input should be a valid string"; each now names the field and what it accepts (still a 400)."""
    content = "the content must be a string or a list of text parts"
    for value, got in ((5, "got a number"), ({"text": "Hi"}, "got an object"), (True, "got a boolean")):
        r = http.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": value}], "max_tokens": 1})
        assert r.status_code == 400, r.text
        err = r.json()["error"]
        assert err["param"] == "messages[0].content" and "'messages[0].content'" in err["message"], err
        assert content in err["message"] and got in err["message"] and "valid string" not in err["message"], err
    accepted = "the prompt must be a string, a list of one string, or a list of token ids (integers)"
    for value, got in (([[1, 2], [3]], "got a list of lists (a batch of prompts): send one prompt per request"),
                       ([[1, 2]], "got a list of lists"), (5, "got a number"), (None, "got null"),
                       ([1, "a"], "a list mixing strings and other values"),
                       ([1, 2.5], "item 1 is 2.5, not a token id"), ([True], "item 0 is a boolean")):
        r = http.post("/v1/completions", json={"prompt": value, "max_tokens": 1})
        assert r.status_code == 400, r.text
        err = r.json()["error"]
        assert err["param"] == "prompt" and accepted in err["message"] and got in err["message"], err
    for value in ("Hi", ["Hi"], [1, 2, 3.0]):  # what is accepted still is
        assert http.post("/v1/completions", json={"prompt": value, "max_tokens": 1}).status_code == 200
    for value, got in ((5, "got a number"), (["a", 5], "item 1 is a number"), ({"a": 1}, "got an object")):
        r = http.post("/v1/completions", json={"prompt": "Hi", "stop": value, "max_tokens": 1})
        assert r.status_code == 400, r.text
        err = r.json()["error"]
        assert err["param"] == "stop" and "stop must be a string or a list of strings" in err["message"], err
        assert got in err["message"] and "valid string" not in err["message"], err


def test_unknown_model_is_404_model_not_found(http, client):
    """OpenAI answers an unknown model with 404, invalid_request_error, code model_not_found (was 400); the
    served id, its aliases and null are accepted; the OpenAPI schema documents the 404."""
    for path, body in (("/v1/chat/completions", {"messages": chat_msgs("Hi")}), ("/v1/completions", {"prompt": "Hi"})):
        for stream in (False, True):
            r = http.post(path, json={**body, "model": "gpt-4o", "max_tokens": 1, "stream": stream})
            assert r.status_code == 404, r.text
            assert r.json()["error"] | {"message": None} == {"message": None, "type": "invalid_request_error",
                                                              "param": "model", "code": "model_not_found"}
            assert "gpt-4o" in r.json()["error"]["message"]
        for name in (MODEL_ID, "default_model", None):
            assert http.post(path, json={**body, "model": name, "max_tokens": 1}).status_code == 200
    with pytest.raises(openai.NotFoundError) as e:
        client.chat.completions.create(model="gpt-4o", messages=chat_msgs("Hi"), max_tokens=1)
    assert e.value.code == "model_not_found"
    r = http.get("/v1/models/gpt-4o")
    assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"
    assert r.json()["error"]["type"] == "invalid_request_error"
    paths = http.get("/openapi.json").json()["paths"]
    for path in ("/v1/chat/completions", "/v1/completions", "/v1/models/{model_id}"):
        method = "get" if "models" in path else "post"
        assert "404" in paths[path][method]["responses"], path


BAD_COMPLETIONS = [
    ({"prompt": None}, "prompt"),
    ({"prompt": []}, "prompt"),
    ({"prompt": ["a", "b"]}, "prompt"),
    ({"prompt": [1, -5]}, "prompt"),
    ({"prompt": [10**9]}, "prompt"),
    ({"prompt": ""}, "prompt"),
    ({"logprobs": 50}, "logprobs"),
    ({"logprobs": True}, "logprobs"),
    ({"echo": True}, "echo"),
    ({"suffix": "x"}, "suffix"),
    ({"best_of": 3}, "best_of"),
    ({"n": 2}, "n"),
    ({"stop": [""]}, "stop"),
    ({"max_tokens": 0}, "max_tokens"),
]


@pytest.mark.parametrize("patch,param", BAD_COMPLETIONS, ids=[p for _, p in BAD_COMPLETIONS])
def test_bad_completion_payloads(http, patch, param):
    r = http.post("/v1/completions", json={"prompt": "Hello", "max_tokens": 2, **patch})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param, r.json()
    assert http.post("/v1/completions", json={"prompt": "Hello", "max_tokens": 1}).status_code == 200


def test_malformed_bodies(http):
    for content, headers in ((b"{not json", {"content-type": "application/json"}),
                             (b"[1, 2]", {"content-type": "application/json"}),
                             (b"", {"content-type": "application/json"}),
                             (b"messages=hi", {"content-type": "application/x-www-form-urlencoded"})):
        r = http.post("/v1/chat/completions", content=content, headers=headers)
        assert r.status_code == 400, (content, r.status_code, r.text)
        assert r.json()["error"]["type"] == "invalid_request_error"
    assert http.get("/v1/chat/completions").status_code == 405
    m = metrics(http)
    assert m["request_errors_total"] >= 4


def test_context_limit(http, smol_f32):
    long_ids = [1000 + (i % 500) for i in range(MAX_CONTEXT + 10)]
    r = http.post("/v1/completions", json={"prompt": long_ids, "max_tokens": 4})
    assert r.status_code == 400
    err = r.json()["error"]
    assert err["code"] == "context_length_exceeded" and str(MAX_CONTEXT) in err["message"]
    r = http.post("/v1/chat/completions", json={"messages": chat_msgs("word " * 600), "stream": True})
    assert r.status_code == 400 and r.json()["error"]["code"] == "context_length_exceeded"
    assert http.get("/health").json()["status"] == "ok"
    # a prompt that fits is generated up to the limit and ends with "length" (on a server of 64 tokens: a prompt
    # of 509 took 5 s to prefill here)
    small = make_server(*smol_f32, engine_kw={"max_context": 64})
    try:
        r = httpx.post(f"{small.url}/v1/completions", json={"prompt": long_ids[:61], "max_tokens": 50}, timeout=120)
        assert r.status_code == 200, r.text
        assert r.json()["usage"]["completion_tokens"] == 3 and r.json()["choices"][0]["finish_reason"] == "length"
        assert httpx.get(f"{small.url}/health").json()["status"] == "ok"
    finally:
        small.stop()


# ----------------------------------------------------------------------------
# Behaviour under load
# ----------------------------------------------------------------------------

LOAD_PROMPTS = [
    "Write a haiku about autumn.",
    "What is 12 times 12?",
    "Give me a synonym for happy.",
    "Name a famous physicist.",
    "What color is the sky at noon?",
    "Describe a cat in one sentence.",
    "What is the boiling point of water?",
    "Say something nice.",
]


def _stream_once(url, prompt, max_tokens, block_size=None):
    body = {"messages": chat_msgs(prompt), "max_tokens": max_tokens, "stream": True}
    if block_size:
        body["num_draft_tokens"] = block_size
    t0 = time.perf_counter()
    text, first = "", None
    with httpx.stream("POST", f"{url}/v1/chat/completions", json=body, timeout=300) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            d = json.loads(line[6:])
            assert "error" not in d, d
            for c in d["choices"]:
                t = c["delta"].get("content")
                if t:
                    first = first or time.perf_counter()
                    text += t
    return text, time.perf_counter() - t0


def run_load(url, clients, per_client, max_tokens, prompts=LOAD_PROMPTS):
    """``clients`` concurrent streaming clients x ``per_client`` requests; returns
    ({(client, i): text}, latencies, wall seconds)."""
    jobs = [(c, i, prompts[(c * per_client + i) % len(prompts)]) for c in range(clients) for i in range(per_client)]
    results, lats = {}, []

    def one_client(c):
        for cc, i, p in jobs:
            if cc == c:
                text, lat = _stream_once(url, p, max_tokens)
                results[(c, i)] = (p, text)
                lats.append(lat)

    t0 = time.perf_counter()
    with ThreadPoolExecutor(clients) as ex:
        list(ex.map(one_client, range(clients)))
    return results, lats, time.perf_counter() - t0


def check_load(srv, http, clients, per_client, max_tokens):
    solo = {p: _stream_once(srv.url, p, max_tokens)[0] for p in LOAD_PROMPTS}
    before = metrics(http)
    results, lats, wall = run_load(srv.url, clients, per_client, max_tokens)
    after = metrics(http)
    assert len(results) == clients * per_client
    for (c, i), (p, text) in results.items():
        assert text == solo[p], (c, i, p)  # no cross-talk: each output equals its solo run
    assert after["request_errors_total"] == before["request_errors_total"]
    tokens = after["generated_tokens_total"] - before["generated_tokens_total"]
    lats.sort()
    p95 = lats[min(len(lats) - 1, int(round(0.95 * (len(lats) - 1))))]
    print(f"\nload {clients}x{per_client}: {tokens} tokens in {wall:.2f}s = {tokens / wall:.1f} tok/s aggregate; "
          f"latency p50 {statistics.median(lats):.2f}s p95 {p95:.2f}s")


@pytest.mark.slow  # 11 s; concurrent requests == solo: test_batched_concurrent_greedy_requests_equal_solo and
def test_concurrent_requests_equal_solo_runs(srv, http):  # test_every_request_kind_batched_equals_solo by default
    check_load(srv, http, clients=4, per_client=2, max_tokens=8)


@pytest.mark.slow
def test_load_8_clients_x_5_requests(srv, http):
    check_load(srv, http, clients=8, per_client=5, max_tokens=24)


def test_requests_are_served_concurrently(srv):
    """A short request started while a long one is generating finishes first."""
    done = {}

    def run(name, prompt, n):
        _stream_once(srv.url, prompt, n)
        done[name] = time.perf_counter()

    long = threading.Thread(target=run, args=("long", "Write a long story about a dragon.", 24))
    long.start()
    deadline = time.time() + 30
    while srv.engine.active == 0 and time.time() < deadline:
        time.sleep(0.01)
    time.sleep(0.3)
    run("short", "Say hi.", 3)
    long.join()
    assert done["short"] < done["long"]


def test_client_disconnect_cancels_generation(srv, http):
    before = metrics(http)
    body = {"messages": chat_msgs("Write a very long essay about the history of Rome."), "max_tokens": 400,
            "stream": True}
    with httpx.stream("POST", f"{srv.url}/v1/chat/completions", json=body, timeout=60) as r:
        got = 0
        for line in r.iter_lines():
            if line.startswith("data: "):
                got += 1
            if got >= 4:
                break  # leave: the connection is closed
    m = _wait_for_cancel(http, before)
    assert m["requests_cancelled_total"] == before["requests_cancelled_total"] + 1
    assert m["requests_active"] == 0
    assert m["generated_tokens_total"] == before["generated_tokens_total"]  # never finished
    assert http.post("/v1/completions", json={"prompt": "Hi", "max_tokens": 1}).status_code == 200


# ----------------------------------------------------------------------------
# Batched rounds (greedy requests share one target forward per round)
# ----------------------------------------------------------------------------


@pytest.fixture(scope="module")
def rr_srv(smol_f32):
    """The same server with batching off: every request gets its own rounds (the solo reference)."""
    target, tokenizer = smol_f32
    s = make_server(target, tokenizer, engine_kw={"max_batch": 0})
    yield s
    s.stop()


def _stream_completion(url, body, leave_after=None):
    """Stream a /v1/completions request: (text, finish_reason, completion_tokens); ``leave_after``: close
    the connection after that many data chunks (returns None)."""
    text, finish, usage, got = "", None, None, 0
    body = {**body, "stream": True, "stream_options": {"include_usage": True}}
    with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=300) as r:
        assert r.status_code == 200, r.read()
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            got += 1
            if leave_after is not None and got >= leave_after:
                return None
            d = json.loads(line[6:])
            assert "error" not in d, d
            for c in d["choices"]:
                text += c.get("text") or ""
                finish = c.get("finish_reason") or finish
            usage = d.get("usage") or usage
    return text, finish, usage["completion_tokens"]


_solo_answers: dict = {}


def _solo(url, body):
    """The solo server's (``rr_srv``) streamed answer to ``body``, asked once per session: greedy and seeded
    answers are deterministic (warm == cold is tested), so the batching tests that compare with the same
    solo answers share them."""
    key = (url, json.dumps(body, sort_keys=True))
    if key not in _solo_answers:
        _solo_answers[key] = _stream_completion(url, body)
    return _solo_answers[key]


BATCH_REQS = [
    {"prompt": "The capital of France is", "max_tokens": 12},
    {"prompt": "Once upon a time, in a small village,", "max_tokens": 16},
    {"prompt": "def fibonacci(n):", "max_tokens": 7},
    {"prompt": "List of fruits: apple, banana,", "max_tokens": 14},
    {"prompt": "1, 2, 3, 4,", "max_tokens": 3},
]


def _run_together(url, bodies, extra=()):
    """All ``bodies`` (and the callables ``extra``) started at once; their results in order."""
    with ThreadPoolExecutor(len(bodies) + len(extra)) as ex:
        futs = [ex.submit(_stream_completion, url, b) for b in bodies] + [ex.submit(f) for f in extra]
        return [f.result() for f in futs]


def test_batched_concurrent_greedy_requests_equal_solo(srv, rr_srv, http):
    """Concurrent greedy requests (different prompts, max_tokens, a stop string) go through one batched
    round and each gets exactly its solo output (text, finish reason, usage), the solo reference being
    the round-robin path; a bad request sent meanwhile is still a 400, and /metrics shows the batch."""
    text = _solo(rr_srv.url, BATCH_REQS[1])[0]
    stop = text[len(text) // 2: len(text) // 2 + 3]
    bodies = BATCH_REQS + [{**BATCH_REQS[1], "stop": [stop]}]
    solo = [_solo(rr_srv.url, b) for b in bodies]
    assert solo[-1][:2] == (text[: text.index(stop)], "stop")
    assert [_stream_completion(srv.url, b) for b in bodies] == solo  # one at a time: a batch of one
    before = metrics(http)

    def bad():
        return http.post("/v1/completions", json={"prompt": [10 ** 7], "max_tokens": 2}).status_code

    got = _run_together(srv.url, bodies, extra=[bad])
    after = metrics(http)
    assert got[:-1] == solo
    assert got[-1] == 400
    rounds = after["batch_rounds_total"] - before["batch_rounds_total"]
    rows = after["batch_rows_total"] - before["batch_rows_total"]
    assert rounds > 0 and rows / rounds > 1.5, (rows, rounds)  # they really shared rounds
    assert after["batch_verified_tokens_per_round"] > 1 and after["batch_size"] == 0
    sched = after["batch_schedule"]  # what the width schedule measured, per batch size
    assert sched and all(v["caps"] and str(v["best_cap"]) in v["caps"] for v in sched.values()), sched
    assert sum(c["rounds"] for v in sched.values() for c in v["caps"].values()) > 0
    assert after["requests_active"] == 0
    assert "mlx_dflash2_batch_size_mean" in http.get("/metrics").text
    # the batched steps by kind (session 46: where a server's time goes, for its benchmark): every round counted
    # once, joins included, each kind's seconds with it
    kinds = ("join", "lone", "drafting", "plain")
    steps = {k: after[f"batch_{k}_steps_total"] - before[f"batch_{k}_steps_total"] for k in kinds}
    secs = {k: after[f"batch_{k}_seconds_total"] - before[f"batch_{k}_seconds_total"] for k in kinds}
    assert steps["join"] >= 1 and steps["drafting"] + steps["plain"] >= 1, steps
    assert sum(steps.values()) - steps["join"] <= rounds <= sum(steps.values()), (steps, rounds)
    assert all((secs[k] > 0) == (steps[k] > 0) for k in kinds), (steps, secs)
    assert "mlx_dflash2_batch_plain_seconds_total" in http.get("/metrics").text
    # the worker's other parts (session 47): the requests' set-up, joins, emissions and ends timed, inside its busy time
    parts = {k: after[f"worker_{k}_seconds_total"] - before[f"worker_{k}_seconds_total"]
             for k in ("start", "add", "emit", "close", "post")}
    assert all(v > 0 for v in parts.values()), parts
    busy = after["busy_s"] - before["busy_s"]
    assert sum(secs.values()) + parts["add"] + parts["emit"] + parts["close"] <= busy + 1e-6, (secs, parts, busy)
    assert "mlx_dflash2_worker_emit_seconds_total" in http.get("/metrics").text


def test_a_failed_joins_end_counts_as_close_not_as_add(srv, http, monkeypatch):
    """A request the batch refuses at its join (a 400) is closed there: that time counts in
    ``worker_close_seconds_total`` only, not in ``worker_add_seconds_total`` too (the breaker helper of session
    48: the worker's parts then summed to more than its busy time)."""
    import time

    from mlx_dflash2.batch import SpeculativeBatch

    def refuse(self, *a, **k):
        raise ValueError("max_tokens: refused by this test")

    real_close = type(srv.engine)._close_job

    def slow_close(self, job, keep):
        time.sleep(0.3)
        return real_close(self, job, keep)

    before = metrics(http)
    monkeypatch.setattr(SpeculativeBatch, "add", refuse)
    monkeypatch.setattr(type(srv.engine), "_close_job", slow_close)
    r = http.post("/v1/completions", json={"prompt": "Hello", "max_tokens": 4})
    monkeypatch.undo()
    assert r.status_code == 400, r.text
    after = metrics(http)
    add = after["worker_add_seconds_total"] - before["worker_add_seconds_total"]
    close = after["worker_close_seconds_total"] - before["worker_close_seconds_total"]
    assert close >= 0.3 and add < 0.3, (add, close)


def test_batch_size_gauge_is_zero_once_a_stop_string_or_a_cancellation_ends_the_last_request(srv, monkeypatch):
    """``batch_size`` counts the rows of the batched round now: a lone request that ends on a stop string (the
    server ends it, not the loop) or is cancelled leaves it at 0 (a fresh user's find: it stayed 1 while idle).
    The gauge is 0 already when the last chunk is posted (CI caught a client reading /metrics before the engine
    thread set it), so the check below does not race."""
    import time

    from mlx_dflash2.server import engine as engine_mod

    at_finish = []
    post_all = engine_mod.post_all  # the worker hands each turn's events out together (session 47)

    def spy(items):
        at_finish.extend(srv.engine.metrics.batch_size for _, item in items
                         if getattr(item, "finish_reason", None) is not None)
        return post_all(items)

    monkeypatch.setattr(engine_mod, "post_all", spy)
    http = httpx.Client(base_url=srv.url, timeout=300)
    text, finish, _ = _stream_completion(srv.url, {"prompt": "1, 2, 3, 4,", "max_tokens": 12, "stop": ["7"]})
    assert finish == "stop" and "7" not in text
    assert at_finish == [0]
    assert metrics(http)["batch_size"] == 0
    assert _stream_completion(srv.url, {"prompt": "Once upon a time,", "max_tokens": 200}, leave_after=2) is None
    deadline = time.time() + 60
    while (m := metrics(http))["requests_active"] or m["batch_size"]:
        assert time.time() < deadline, m
        time.sleep(0.1)


def test_batched_limit_waits_in_order(smol_f32, rr_srv):
    """More greedy requests than --max-batch: the rest wait for a free row (FIFO) and all are exact."""
    target, tokenizer = smol_f32
    s = make_server(target, tokenizer, engine_kw={"max_batch": 2})
    try:
        solo = [_solo(rr_srv.url, b) for b in BATCH_REQS]
        assert _run_together(s.url, BATCH_REQS) == solo
        m = httpx.get(f"{s.url}/metrics", params={"format": "json"}).json()
        assert 1 < m["batch_size_mean"] <= 2 and m["requests_active"] == 0
    finally:
        s.stop()


def test_sampled_request_alongside_batched_ones(srv, rr_srv):
    """A seeded sampled request served next to greedy ones: every output equals its solo one."""
    sampled = {"prompt": "Tell me a story about a cat.", "max_tokens": 10, "temperature": 0.9, "seed": 5}
    bodies = BATCH_REQS[:3] + [sampled]
    solo = [_solo(rr_srv.url, b) for b in bodies]
    assert _run_together(srv.url, bodies) == solo


def _completion_json(url, body):
    """A non-streaming /v1/completions request: (text, finish_reason, completion_tokens, logprobs)."""
    return _completion_spec(url, body)[:4]


def _completion_spec(url, body):
    """:func:`_completion_json`'s answer and the response's ``speculative`` statistics."""
    r = httpx.post(f"{url}/v1/completions", json=body, timeout=300)
    assert r.status_code == 200, r.text
    d = r.json()
    c = d["choices"][0]
    return c["text"], c["finish_reason"], d["usage"]["completion_tokens"], c.get("logprobs"), d["speculative"]


def test_every_request_kind_batched_equals_solo(srv, rr_srv, http):
    """Concurrent seeded sampled requests (temperature, top-p, top-k, min-p), greedy ones with
    penalties and logit bias, and requests with logprobs / top_logprobs all share the batched rounds
    (nothing goes round-robin on a dense target) and each equals its solo (max_batch=0) output: text,
    finish reason, usage and logprobs."""
    bodies = [
        {"prompt": "Tell me a story about a cat.", "max_tokens": 10, "temperature": 0.9, "seed": 5},
        {"prompt": "The capital of France is", "max_tokens": 9, "temperature": 0.7, "top_p": 0.9, "top_k": 50,
         "seed": 11, "logprobs": 3},
        {"prompt": "List of fruits: apple, banana,", "max_tokens": 12, "repetition_penalty": 1.3,
         "presence_penalty": 0.5, "logit_bias": {"13": 3.0}},
        {"prompt": "Once upon a time, in a small village,", "max_tokens": 8, "logprobs": 2},
        {"prompt": "def fibonacci(n):", "max_tokens": 11, "temperature": 1.1, "min_p": 0.05,
         "frequency_penalty": 0.4, "seed": 3},
        BATCH_REQS[0],
    ]
    solo = [_completion_json(rr_srv.url, b) for b in bodies]
    before = metrics(http)
    with ThreadPoolExecutor(len(bodies)) as ex:
        got = list(ex.map(lambda b: _completion_json(srv.url, b), bodies))
    after = metrics(http)
    for g, s, b in zip(got, solo, bodies):
        assert g[:3] == s[:3], b
        if s[3] is None:
            assert g[3] is None, b
            continue
        assert g[3]["tokens"] == s[3]["tokens"], b
        assert g[3]["token_logprobs"] == pytest.approx(s[3]["token_logprobs"], abs=1e-4), b
        assert g[3]["top_logprobs"] == [pytest.approx(t, abs=1e-4) for t in s[3]["top_logprobs"]], b
    rows = after["batch_rows_total"] - before["batch_rows_total"]
    rounds = after["batch_rounds_total"] - before["batch_rounds_total"]
    forwards = after["target_forwards_total"] - before["target_forwards_total"]
    assert rounds > 0 and rows / rounds > 1.5, (rows, rounds)  # they really shared rounds
    # every request was batched: each of its rounds was a row of a batched round (a round-robin
    # request's rounds would count as target forwards without a row)
    assert rows == forwards, (rows, forwards)


def test_a_lone_request_runs_the_adaptive_schedule_a_seeded_one_drafts_every_round(smol_f32, srv, monkeypatch):
    """Issue 22, "with one request, behave as today": a request alone in the server (a batch of one) has its
    rounds chosen by the drafter's adaptive schedule, as the CLI's solo loop has them (here the shipped
    drafter on a clock where its forward costs ten rounds: the schedule soon runs plain steps), and gets
    the greedy answer; a seeded sampled request alone drafts every round (its tokens must not depend on
    timings)."""
    from mlx_dflash2.drafter.model import DraftModel

    target, tokenizer = smol_f32
    p = make_proposer("shipped", target, tokenizer, MODEL_ID, adaptive=True, calibrate=False)
    clock = [0.0]

    def tick():
        clock[0] += 1.0
        return clock[0]

    orig_call = DraftModel.__call__

    def costly(self, *a, **kw):
        clock[0] += 10.0
        return orig_call(self, *a, **kw)

    monkeypatch.setattr(DraftModel, "__call__", costly)
    p.schedule.clock = tick
    s = make_server(target, tokenizer, p)
    try:
        greedy = {"prompt": "Once upon a time, in a small village,", "max_tokens": 24}
        text, _, n, _, spec = _completion_spec(s.url, greedy)
        assert n == 24 and text == _completion_json(srv.url, greedy)[0]  # the greedy answer (srv: lookup)
        assert spec["drafter"].endswith("(adaptive)") and spec["rounds_by_source"].get("none", 0) >= 10, spec
        seeded = {**greedy, "temperature": 0.8, "seed": 4, "max_tokens": 12}  # 12: drafting rounds cost 0.4 s here
        _, _, n, _, spec = _completion_spec(s.url, seeded)
        assert n == 12 and "adaptive" not in spec["drafter"], spec
        assert spec["rounds_by_source"].get("none", 0) <= 1 and spec["drafted_tokens"] > 0, spec
    finally:
        s.stop()


def test_batched_disconnect_mid_batch_leaves_others_exact(srv, rr_srv, http):
    """A client that leaves while its request is a row of the batch: its row is freed at the next round,
    the others' outputs are unchanged."""
    solo = [_solo(rr_srv.url, b) for b in BATCH_REQS[:3]]
    before = metrics(http)
    leaver = {"prompt": "Write a very long essay about the history of Rome.", "max_tokens": 200}
    got = _run_together(srv.url, BATCH_REQS[:3],
                        extra=[lambda: _stream_completion(srv.url, leaver, leave_after=3)])
    assert got[:3] == solo and got[3] is None
    m = _wait_for_cancel(http, before)
    assert m["requests_cancelled_total"] == before["requests_cancelled_total"] + 1
    assert m["requests_active"] == 0 and m["batch_size"] == 0


def test_a_request_whose_emission_fails_leaves_the_others_exact(srv, rr_srv, http, monkeypatch):
    """A request whose tokens cannot be handed out (its text stream raises mid-way) ends with a 500 error
    chunk and leaves the batch; the other rows of the same step still get every token (session 48 noticed:
    the exception left the turn, so the step's later events, other requests' tokens, were lost)."""
    import time

    from mlx_dflash2 import api

    solo = [_solo(rr_srv.url, b) for b in BATCH_REQS[:3]]
    before = metrics(http)
    add, streams = api.TextStream.add, []

    def flaky(self, token):
        if self not in streams:
            streams.append(self)
        others = [t for t in streams if t is not self and t.n >= 1]
        if "@@boom@@" in self.stopper.stops and len(others) >= 3:  # every other request is a row by now
            raise RuntimeError("detokenizer broke")
        return add(self, token)

    monkeypatch.setattr(api.TextStream, "add", flaky)

    def boom():
        body = {"prompt": "Once upon a time,", "max_tokens": 200, "stop": ["@@boom@@"], "stream": True}
        with httpx.stream("POST", f"{srv.url}/v1/completions", json=body, timeout=300) as r:
            assert r.status_code == 200
            return [json.loads(l[6:]) for l in r.iter_lines() if l.startswith("data: ") and l != "data: [DONE]"]

    with ThreadPoolExecutor(1) as ex:
        fut = ex.submit(boom)  # it joins first, so its row's events come before the others' in every step
        deadline = time.time() + 120
        while not any(t.n >= 1 for t in streams):
            assert time.time() < deadline and not fut.done()
            time.sleep(0.01)
        got = _run_together(srv.url, BATCH_REQS[:3])
        chunks = fut.result()
    assert got == solo
    assert chunks and "internal error: RuntimeError: detokenizer broke" in chunks[-1]["error"]["message"], chunks[-1]
    m = metrics(http)
    assert m["request_errors_total"] == before["request_errors_total"] + 1
    assert m["requests_active"] == 0 and m["batch_size"] == 0


def test_keepalive_comments_during_prefill(srv):
    prompt = "Summarize this text. " + " ".join(f"Sentence number {i} is here." for i in range(40))
    lines = []
    with httpx.stream("POST", f"{srv.url}/v1/chat/completions", timeout=120,
                      json={"messages": chat_msgs(prompt), "max_tokens": 2, "stream": True}) as r:
        lines = list(r.iter_lines())
    keep = [l for l in lines if l.startswith(": keep-alive")]
    assert len(keep) >= 3, lines[:6]  # one per prefill chunk of 64 tokens
    assert lines[-2:] == ["data: [DONE]", ""] or lines[-1] == "data: [DONE]"


def test_prompt_cache_multi_turn_warm_equals_cold(srv, client):
    kw = dict(model=MODEL_ID, max_tokens=10)
    msgs = chat_msgs("Tell me one fact about the Moon.")
    first = client.chat.completions.create(messages=msgs, **kw)
    msgs = msgs + [{"role": "assistant", "content": first.choices[0].message.content},
                   {"role": "user", "content": "And one about Mars?"}]
    warm = client.chat.completions.create(messages=msgs, **kw)
    assert warm.usage.prompt_tokens_details.cached_tokens >= first.usage.prompt_tokens
    srv.engine.call(srv.engine.prompt_cache.clear)
    cold = client.chat.completions.create(messages=msgs, **kw)
    assert cold.usage.prompt_tokens_details.cached_tokens == 0
    assert warm.choices[0].message.content == cold.choices[0].message.content
    # a third turn reuses the second
    msgs = msgs + [{"role": "assistant", "content": cold.choices[0].message.content},
                   {"role": "user", "content": "Thanks!"}]
    third = client.chat.completions.create(messages=msgs, **kw)
    assert third.usage.prompt_tokens_details.cached_tokens >= cold.usage.prompt_tokens
    assert len(srv.engine.prompt_cache) <= srv.engine.prompt_cache.max_entries


def test_prompt_cache_bounded_and_drafter_context_reuse(smol_f32):
    """Engine-level: a DFlash2 drafter's context is reused (taken over or copied)
    and warm output equals cold output; the cache keeps at most N states."""
    import asyncio

    from mlx_dflash2.server.engine import Job, TokenOut

    target, tokenizer = smol_f32
    p = make_proposer("init", target, tokenizer, MODEL_ID)
    model = SpeculativeModel(target, p, 4, MODEL_ID, target.config)
    engine = Engine(model, tokenizer, EngineConfig(prompt_cache_size=2))
    engine.start()

    def run(messages):
        loop = asyncio.new_event_loop()
        job = Job(kind="chat", messages=messages, max_tokens=6, loop=loop, queue=asyncio.Queue())
        engine.submit(job)
        out = []

        async def collect():
            while True:
                ev = await asyncio.wait_for(job.queue.get(), 120)
                if isinstance(ev, TokenOut):
                    out.append(ev.token)
                    if ev.finish_reason:
                        return ev

        try:
            last = loop.run_until_complete(collect())
        finally:
            loop.close()
        return out, last.usage["cached_tokens"]

    try:
        m1 = chat_msgs("What is a prime number?")
        a, _ = run(m1)
        m2 = m1 + [{"role": "assistant", "content": tokenizer.decode(a)}, {"role": "user", "content": "Example?"}]
        warm, cached = run(m2)
        assert cached > 0
        again, cached2 = run(m2)  # the cached state now extends past this prompt: a copy is used
        assert cached2 > 0 and again == warm
        engine.call(engine.prompt_cache.clear)
        cold, cached3 = run(m2)
        assert cached3 == 0 and cold == warm
        for q in ("One", "Two", "Three"):
            run(chat_msgs(q))
        assert len(engine.prompt_cache) <= 2
    finally:
        engine.stop()


# ----------------------------------------------------------------------------
# A Qwen-style target: embedding rows past the tokenizer
# ----------------------------------------------------------------------------


@pytest.fixture(scope="module")
def padded_srv(padded_dir):
    """The real server path on a padded-vocabulary target with a fresh DFlash drafter: the command line's
    build_app loads everything on this thread, the engine's worker thread generates."""
    from mlx_dflash2.server.cli import build_app, setup_arg_parser

    args = setup_arg_parser().parse_args(
        ["--model", str(padded_dir), "--drafter", "init", "--block-size", "4", "--max-tokens", "24",
         "--max-context", str(MAX_CONTEXT), "--prefill-step-size", "64", "--log-level", "WARNING"])
    app, _ = build_app(args)
    s = LiveServer(app)
    yield s
    s.stop()


def test_padded_vocabulary_target_with_dflash_drafter(padded_srv):
    """`--model <padded target> --drafter init` answers drafting requests (it answered every one with a 500,
    "There is no Stream(cpu, 0) in current thread": the drafter's padded-row mask was made lazily on the
    loading thread); no padding id is ever emitted, and speculative output equals plain decoding."""
    from conftest import PADDED_ROWS

    eng = padded_srv.engine
    assert eng.model.target.vocab_rows == PADDED_ROWS > eng.vocab_size
    assert "DFlash2DraftModel" in eng.model.proposer.name
    c = openai.OpenAI(base_url=f"{padded_srv.url}/v1", api_key="x", max_retries=0, timeout=120)
    kw = dict(model="default_model", messages=chat_msgs("Tell me a story about a lighthouse."), max_tokens=24)
    spec = c.chat.completions.create(**kw)
    assert spec.model_extra["speculative"]["drafted_tokens"] > 0
    assert spec.model_extra["speculative"]["draft_vocab"] == 0  # the drafter proposes from every id
    plain = c.chat.completions.create(extra_body={"num_draft_tokens": 1}, **kw)
    assert spec.choices[0].message.content == plain.choices[0].message.content
    streamed, _, finish, usage, _ = stream_chat(c, stream_options={"include_usage": True}, **kw)
    assert streamed == spec.choices[0].message.content and finish == spec.choices[0].finish_reason
    sampled = c.completions.create(model="default_model", prompt="Once upon a time", max_tokens=24, temperature=1.0,
                                   seed=3, logprobs=2)
    assert sampled.usage.completion_tokens == len(sampled.choices[0].logprobs.tokens) > 0
    # every request's final state (prompt + emitted tokens) is in the prompt cache: no id past the tokenizer
    emitted = eng.call(lambda: [t for st in eng.prompt_cache._entries.values() for t in st.tokens])
    assert emitted and max(emitted) < eng.vocab_size
    assert httpx.get(f"{padded_srv.url}/metrics", params={"format": "json"}).json()["request_errors_total"] == 0


# ----------------------------------------------------------------------------
# Thinking models: reasoning_content
# ----------------------------------------------------------------------------


def test_reasoning_splitter_any_segmentation():
    raw = "<think>Let me think: 2+2.</think>The answer is 4. <thi no marker"
    rng = random.Random(0)
    for _ in range(200):
        cuts = sorted(rng.sample(range(1, len(raw)), rng.randint(0, 12)))
        parts = [raw[i:j] for i, j in zip([0] + cuts, cuts + [len(raw)])]
        sp = ReasoningSplitter("<think>", "</think>")
        segs = [s for p in parts for s in sp.feed(p)] + sp.flush()
        content = "".join(t for k, t in segs if k == "content")
        reasoning = "".join(t for k, t in segs if k == "reasoning")
        assert reasoning == "Let me think: 2+2."
        assert content == "The answer is 4. <thi no marker"
    sp = ReasoningSplitter("<think>", "</think>", reasoning=True)  # the prompt opened the block
    assert sp.feed("hmm</think>ok") == [("reasoning", "hmm"), ("content", "ok")]
    assert ReasoningSplitter().feed("<think>x</think>") == [("content", "<think>x</think>")]
    sp = ReasoningSplitter("<think>", "</think>")
    assert sp.feed("a</thi") == [("content", "a</thi")] and sp.flush() == []
    # reasoning tokens: from the token completing the start marker through the one completing the end marker
    sp = ReasoningSplitter("<think>", "</think>")
    pieces = ["Hi", "<th", "ink>", "hmm", "</", "think>", "ok"]
    assert [sp.feed_token(p)[1] for p in pieces] == [False, False, True, True, True, True, False]
    sp = ReasoningSplitter("<think>", "</think>", reasoning=True)
    assert [sp.feed_token(p)[1] for p in ("x", "</think>", "y")] == [True, True, False]
    assert ReasoningSplitter().feed_token("<think>") == ([("content", "<think>")], False)


class _FakeThinking:
    has_thinking = True
    think_start, think_end = "<think>", "</think>"
    response_initial_state = None

    def decode(self, ids):
        return "".join(chr(i) for i in ids)


def test_initial_reasoning_state():
    t = _FakeThinking()
    assert initial_reasoning_state(t, [ord(c) for c in "user: hi\n<think>\n"])
    assert not initial_reasoning_state(t, [ord(c) for c in "<think>\n\n</think>\n\n"])
    t.has_thinking = False
    assert not initial_reasoning_state(t, [ord(c) for c in "<think>"])


class ThinkingProxy:
    """The real tokenizer, presented as a thinking model whose markers are common words."""

    def __init__(self, tok, start, end):
        self._tok, self.think_start, self.think_end = tok, start, end
        self.has_thinking = True
        self.response_initial_state = None

    def rfind_think_start(self, ids):
        return -1

    def rfind_think_end(self, ids):
        return -1

    def __len__(self):
        return len(self._tok)

    def __getattr__(self, name):
        return getattr(self._tok, name)


@pytest.fixture(scope="module")
def thinking(srv, smol_f32):
    """A server whose tokenizer is presented as a thinking model, with markers taken from the plain answer to
    FRUITS: ``(server, client, kw, raw answer, start marker, end marker)``."""
    target, tokenizer = smol_f32
    kw = dict(model=MODEL_ID, messages=chat_msgs(FRUITS), max_tokens=20)
    raw = openai.OpenAI(base_url=f"{srv.url}/v1", api_key="x").chat.completions.create(**kw)
    raw = raw.choices[0].message.content
    lines = raw.split("\n")
    assert len(lines) >= 4, raw
    start, end = lines[1].split()[-1], lines[3].split()[-1]  # e.g. "Apples" opens the "thinking", "Grapes" closes it
    assert raw.count(start) == 1 and raw.count(end) == 1 and raw.index(start) < raw.index(end)
    s = make_server(target, tokenizer, tokenizer_proxy=ThinkingProxy(tokenizer, start, end))
    c = openai.OpenAI(base_url=f"{s.url}/v1", api_key="x", max_retries=0)
    yield s, c, kw, raw, start, end
    s.stop()


@pytest.fixture(scope="module")
def thinking_answers(thinking):
    """The thinking server's answers to its request, with the drafter (``None``) and without (block size 1),
    each non-streamed and streamed with the usage chunk: ``{B: (completion, stream_chat(...))}``, read by the
    reasoning_content test and by the reasoning_tokens test."""
    s, c, kw, raw, start, end = thinking
    out = {}
    for B in (None, 1):
        extra = {"num_draft_tokens": B} if B else {}
        out[B] = (c.chat.completions.create(extra_body=extra, **kw),
                  stream_chat(c, extra_body=extra, stream_options={"include_usage": True}, **kw))
    return out


def test_reasoning_content_same_with_and_without_drafter(thinking, thinking_answers):
    s, c, kw, raw, start, end = thinking
    seen = []
    for B in (None, 1):  # with the drafter, and without (block size 1)
        completion, streamed = thinking_answers[B]
        full = completion.choices[0].message
        reasoning = full.model_extra["reasoning_content"]
        assert start not in full.content and reasoning and reasoning in raw
        assert raw == full.content[: raw.index(start)] + start + reasoning + end + full.content[raw.index(start):]
        content, sreasoning, *_ = streamed
        assert (content, sreasoning) == (full.content, reasoning)
        seen.append((full.content, reasoning))
    assert seen[0] == seen[1]


def test_usage_reports_reasoning_tokens(thinking, thinking_answers, smol_f32):
    """usage.completion_tokens_details.reasoning_tokens (OpenAI's field) counts the emitted tokens of the
    thinking block, from the one completing the start marker through the one completing the end marker:
    the same streamed or not, with or without the drafter, and 0 for text completions and other requests."""
    from mlx_dflash2.api import stream_generate

    s, c, kw, raw, start, end = thinking
    target, tok = smol_f32
    model = SpeculativeModel(target, None, 1, MODEL_ID, target.config)
    ids = [r.token for r in stream_generate(model, tok, tok.apply_chat_template(kw["messages"],
                                                                                add_generation_prompt=True),
                                            max_tokens=kw["max_tokens"])]
    assert tok.decode(ids) == raw
    first = next(k for k in range(len(ids)) if start in tok.decode(ids[: k + 1]))
    last = next(k for k in range(len(ids)) if end in tok.decode(ids[: k + 1]))
    expected = last - first + 1
    assert 3 < expected < len(ids)
    for B in (None, 1):
        completion, streamed = thinking_answers[B]
        u = completion.usage
        assert u.completion_tokens == len(ids)
        assert u.completion_tokens_details.reasoning_tokens == expected
        *_, su, _ = streamed
        assert su.completion_tokens_details.reasoning_tokens == expected
    cut = c.chat.completions.create(**{**kw, "max_tokens": first + 3}).usage  # stopped inside the block
    assert cut.completion_tokens_details.reasoning_tokens == 3 <= cut.completion_tokens
    assert c.completions.create(model=MODEL_ID, prompt="Hi", max_tokens=3).usage.completion_tokens_details \
        .reasoning_tokens == 0
    hi = c.chat.completions.create(**{**kw, "messages": chat_msgs("Hi")})
    assert start not in hi.choices[0].message.content and hi.usage.completion_tokens_details.reasoning_tokens == 0


# ----------------------------------------------------------------------------
# Schema fuzzing and the command line
# ----------------------------------------------------------------------------


@pytest.fixture(scope="module")
def fuzz_srv(smol_f32):
    target, tokenizer = smol_f32
    # a tiny context keeps every generated answer short (random prompts are mostly refused as too long)
    s = make_server(target, tokenizer, engine_kw={"max_context": 44}, settings_kw={"max_tokens": 4})
    yield s
    s.stop()


def _fuzz(url, max_examples):
    import hypothesis
    import schemathesis
    from schemathesis.checks import not_a_server_error
    from schemathesis.generation import GenerationMode

    schema = schemathesis.openapi.from_url(f"{url}/openapi.json")
    ops = [r.ok() for r in schema.get_all_operations()]
    assert len(ops) >= 6
    seen: dict = {}
    for op in ops:
        for mode in (GenerationMode.POSITIVE, GenerationMode.NEGATIVE):
            @hypothesis.settings(max_examples=max_examples, deadline=None, derandomize=True, database=None,
                                 suppress_health_check=list(hypothesis.HealthCheck))
            @hypothesis.given(case=op.as_strategy(generation_mode=mode))
            def check(case):
                if mode.is_positive and isinstance(case.body, dict) and isinstance(case.body.get("model"), str):
                    # a random model name is a valid request answered 404 model_not_found (tested on its
                    # own); the fuzzer's valid requests name the served model so they reach generation
                    case.body["model"] = "default_model"
                r = case.call(base_url=url, timeout=120)
                key = (case.path, mode.value, r.status_code)
                seen[key] = seen.get(key, 0) + 1
                if os.environ.get("FUZZ_DEBUG") and r.status_code == 400 and mode.is_positive:
                    print(case.body, r.json()["error"]["message"][:100])
                assert r.status_code < 500, (case.method, case.path, case.body, r.status_code, r.text)
                case.validate_response(r, checks=[not_a_server_error])

            try:
                check()
            except hypothesis.errors.Unsatisfiable:
                assert mode == GenerationMode.NEGATIVE  # nothing invalid to send (no parameters)
    print("\nschema fuzzing, (path, mode, status): count", sorted(seen.items()))
    # the generation endpoints did generate (status 200) for some valid requests
    assert seen.get(("/v1/chat/completions", "positive", 200)) and seen.get(("/v1/completions", "positive", 200))


def test_schema_fuzzing_finds_no_server_error(fuzz_srv, http):
    _fuzz(fuzz_srv.url, max_examples=6)  # 150 in the slow test_schema_fuzzing_long
    assert httpx.get(f"{fuzz_srv.url}/health").json()["status"] == "ok"


@pytest.mark.slow
def test_schema_fuzzing_long(fuzz_srv):
    _fuzz(fuzz_srv.url, max_examples=150)


def test_python_m_server_starts_and_serves(smol_f32):
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    sock.close()
    root = Path(__file__).resolve().parents[1]
    env = {**os.environ, "PYTHONPATH": str(root) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    proc = subprocess.Popen(
        [sys.executable, "-m", "mlx_dflash2.server", "--port", str(port), "--drafter", "lookup", "--max-tokens",
         "3", "--log-level", "WARNING", "--chat-template-args", '{"custom": "!"}',
         "--chat-template", "{% for m in messages %}[{{ m['content'] }}{{ custom }}]{% endfor %}"],
        cwd=root, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
    )
    try:
        url = f"http://127.0.0.1:{port}"
        deadline = time.time() + 120
        while True:
            try:
                if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            assert proc.poll() is None, proc.stdout.read().decode()
            assert time.time() < deadline, "server did not come up"
            time.sleep(0.3)
        c = openai.OpenAI(base_url=f"{url}/v1", api_key="x", max_retries=0)
        r = c.chat.completions.create(model="default_model", messages=chat_msgs("Hi"))
        assert r.usage.completion_tokens <= 3 and r.model == MODEL_ID
        # the --chat-template and its --chat-template-args rendered the prompt
        assert r.usage.prompt_tokens == len(smol_f32[1].encode("[Hi!]", add_special_tokens=False))
        # Ctrl-C (one SIGINT, an idle server): a clean exit, no traceback (uvicorn re-raises the signal it caught
        # after its shutdown; a fresh user's finding, session 23)
        proc.send_signal(signal.SIGINT)
        out = proc.communicate(timeout=60)[0].decode()
        assert proc.returncode == 0 and "Traceback" not in out, out
    finally:
        if proc.poll() is None:
            proc.terminate()
            proc.wait(30)
    bad = subprocess.run([sys.executable, "-m", "mlx_dflash2.server", "--max-tokens", "0"], cwd=root, env=env,
                         capture_output=True, text=True)
    assert bad.returncode == 2 and "max-tokens" in bad.stderr


# ----------------------------------------------------------------------------
# Hybrid (GatedDeltaNet) and sliding-window targets behind the server
# ----------------------------------------------------------------------------


@pytest.mark.parametrize("kind", ["qwen3_5", "gemma3"])
def test_hybrid_and_window_targets_served_with_prompt_cache(tmp_path, kind):
    """`mlx_dflash2.server --model <qwen3_5 / gemma3 checkpoint> --drafter init`: drafting requests answer,
    speculative equals plain, and a request sharing a long prefix with an earlier one reuses the prompt
    cache (a recurrent-state snapshot / what the window caches hold) with the same output as cold."""
    from tiny_models import tiny_hybrid_dir

    from mlx_dflash2.server.cli import build_app, setup_arg_parser

    path = tiny_hybrid_dir(tmp_path / kind, kind, window=64)
    args = setup_arg_parser().parse_args(
        ["--model", str(path), "--drafter", "init", "--block-size", "4", "--max-tokens", "16", "--dtype", "float32",
         "--max-context", "2048", "--prefill-step-size", "64", "--log-level", "WARNING"])
    app, _ = build_app(args)
    s = LiveServer(app)
    try:
        c = openai.OpenAI(base_url=f"{s.url}/v1", api_key="x", max_retries=0, timeout=120)
        doc = " ".join(f"item {i} is {i * 7 % 13}." for i in range(90))  # ~700 tokens: snapshots at 256, 512
        kw = dict(model="default_model", max_tokens=16)
        first = c.completions.create(prompt=doc + " Question one?", **kw)
        assert first.model_extra["speculative"]["drafted_tokens"] > 0
        warm = c.completions.create(prompt=doc + " Question two?", **kw)
        plain = c.completions.create(prompt=doc + " Question two?", extra_body={"num_draft_tokens": 1}, **kw)
        assert warm.choices[0].text == plain.choices[0].text
        if kind == "qwen3_5":  # the snapshot at 512 (the prompts share ~720 tokens)
            assert warm.usage.prompt_tokens_details.cached_tokens >= 256
        m = httpx.get(f"{s.url}/metrics", params={"format": "json"}).json()
        assert m["request_errors_total"] == 0
    finally:
        s.stop()


@pytest.mark.parametrize("kind", ["qwen3_5", "gemma3"])
def test_hybrid_target_requests_share_batched_rounds(tmp_path, kind, caplog):
    """A hybrid GatedDeltaNet target (tiny Qwen3.5) and a sliding-window one (tiny Gemma 3, windows of 8
    tokens) are served with batched rounds: concurrent requests (greedy ones of different lengths, a stop
    string, a seeded sampled one) share rounds (/metrics: more than one row per round) and each equals its
    solo output (the same model behind ``--max-batch 0``), the batched server warmed up at start (what a GPU
    backend does by default: every row count and verify width once, outputs unchanged)."""
    import logging

    import mlx.core as mx
    from tiny_models import tiny_hybrid_dir

    from mlx_dflash2.loading import load_target

    target, tok, _ = load_target(str(tiny_hybrid_dir(tmp_path / kind, kind)), dtype=mx.float32)
    proposer = make_proposer("init", target, tok, MODEL_ID)
    model = SpeculativeModel(target, proposer, 4, MODEL_ID, target.config)

    def serve(max_batch):
        engine = Engine(model, tok, EngineConfig(max_context=MAX_CONTEXT, prefill_step_size=16, max_batch=max_batch,
                                                 warmup=max_batch > 0))
        return LiveServer(create_app(engine, ServerSettings(model_id=MODEL_ID, max_tokens=16)))

    bodies = [{"prompt": "The capital of France is", "max_tokens": 12},
              {"prompt": "Once upon a time, in a small village, there lived", "max_tokens": 16},
              {"prompt": "def f(n):", "max_tokens": 7},
              {"prompt": "Tell me a story.", "max_tokens": 10, "temperature": 0.9, "seed": 5}]
    rr = serve(0)
    try:
        assert rr.engine._batch is None
        solo = [_stream_completion(rr.url, b) for b in bodies]
        text = solo[1][0]
        stop = text[len(text) // 2: len(text) // 2 + 2]
        bodies.append({**bodies[1], "stop": [stop]})
        solo.append(_stream_completion(rr.url, bodies[-1]))
    finally:
        rr.stop()
    assert solo[-1][1] == "stop" and solo[-1][0] == text[: text.index(stop)]
    with caplog.at_level(logging.INFO, logger="mlx_dflash2.server"):
        s = serve(8)
    assert "warmed the batched rounds up" in caplog.text and "widths 1,2,4" in caplog.text
    try:
        assert s.engine._batch is not None  # hybrid and window targets batch (they went round-robin before)
        assert _run_together(s.url, bodies) == solo
        m = httpx.get(f"{s.url}/metrics", params={"format": "json"}).json()
        assert m["batch_rounds_total"] > 0 and m["batch_rows_total"] / m["batch_rounds_total"] > 1.5, m
        assert m["request_errors_total"] == 0 and m["requests_active"] == 0
    finally:
        s.stop()


@pytest.mark.parametrize("flags,msg", [
    (["--temp", "-1"], "--temp: must be a number >= 0, got -1.0"),
    (["--top-p", "0"], "--top-p: must be in (0, 1], got 0.0"),
    (["--chat-template", "/nonexistent/template.jinja"], "--chat-template: no such file: /nonexistent/template.jinja"),
])
def test_bad_server_defaults_are_refused_before_loading(capsys, flags, msg):
    """A fresh user's finds (session 24): ``--temp -1`` started a server that answered every request without a
    ``temperature`` with a 400 blaming the client; a ``--chat-template`` file that does not exist became the
    template itself (the answers ignored the user's message). Both are now one error line before loading (the
    model path does not exist either: its error would come later)."""
    from mlx_dflash2.server.cli import main

    assert main(["--model", "/nonexistent/model", "--port", "0", *flags]) == 2  # port 0: 8080 may be taken
    err = capsys.readouterr().err
    assert f"error: {msg}" in err and "not found" not in err.replace("no such file", "")


def test_keepalive_interval_must_be_positive(capsys):
    """``--keepalive-interval 0`` made every stream an endless run of keep-alive comments (a fresh user's find)."""
    from mlx_dflash2.server.cli import setup_arg_parser

    for bad in ("0", "-1", "inf", "nan"):
        with pytest.raises(SystemExit):
            setup_arg_parser().parse_args(["--keepalive-interval", bad])
        assert "seconds > 0" in capsys.readouterr().err
    assert setup_arg_parser().parse_args(["--keepalive-interval", "0.5"]).keepalive_interval == 0.5


def test_switch_interval_must_be_one_the_interpreter_keeps(capsys):
    """``--switch-interval`` past what ``sys.setswitchinterval`` holds (below a microsecond, or ~1.8e13 s where it
    overflows) ran silently at 1 microsecond, and a word gave argparse's message naming an internal function (the
    breaker helper of session 48): each is a clear error naming the option's range."""
    from mlx_dflash2.server.cli import setup_arg_parser

    for bad, why in (("1.9e13", "between 1e-06 and 1"), ("1e-9", "between 1e-06 and 1"), ("2", "between 1e-06 and 1"),
                     ("0", "seconds > 0"), ("-1", "seconds > 0"), ("nan", "seconds > 0"), ("abc", "seconds > 0")):
        with pytest.raises(SystemExit):
            setup_arg_parser().parse_args(["--switch-interval", bad])
        err = capsys.readouterr().err
        assert why in err and "_positive_seconds" not in err and "_switch_interval" not in err, (bad, err)
    assert setup_arg_parser().parse_args(["--switch-interval", "0.0005"]).switch_interval == 0.0005


def test_the_batch_limit_defaults_to_mlx_lm_servers_decode_concurrency():
    """``--max-batch`` (and ``EngineConfig.max_batch``) default to 32, ``mlx_lm.server``'s ``--decode-concurrency``:
    with 8, 16 clients on the 2-core CPU got 58.4 tok/s against ``mlx_lm.server``'s 69.4 (half of them waiting for a
    row, TTFT 6.3 s); with 32, 78.5 (session 27)."""
    from mlx_dflash2.server.cli import setup_arg_parser

    assert setup_arg_parser().parse_args([]).max_batch == EngineConfig().max_batch == 32


@pytest.mark.parametrize("port", ["99999", "-1"])
def test_a_port_out_of_range_is_refused_before_loading(capsys, port):
    """``--port 99999`` was an OverflowError traceback after the model had loaded (a fresh user's run,
    session 15): now argparse refuses it at once, with the range."""
    from mlx_dflash2.server.cli import setup_arg_parser

    with pytest.raises(SystemExit) as e:
        setup_arg_parser().parse_args(["--port", port])
    assert e.value.code == 2 and "0..65535" in capsys.readouterr().err


def test_a_host_or_port_it_cannot_listen_on_is_refused_before_loading(monkeypatch, capsys):
    """A fresh user's find (session 25): ``--host 999.1.1.1`` loaded the model, logged "serving ..." and only
    then failed to bind. A host that does not resolve or is not this machine's, or a port in use, is now one
    error line (exit status 2) before anything loads."""
    from mlx_dflash2.server import cli

    def no_load(args):
        raise AssertionError("the model was loaded before the address was checked")

    monkeypatch.setattr(cli, "build_app", no_load)
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        for flags, msg in ((["--host", "999.1.1.1"], "--host 999.1.1.1: not an IP address or a host name that "
                                                     "resolves"),
                           (["--host", "192.0.2.1"], "--host 192.0.2.1: not an address of this machine"),
                           (["--host", ""], "--host is empty"),  # getaddrinfo took it as every interface
                           (["--port", str(port)], f"--port {port}: already in use on 127.0.0.1")):
            assert cli.main(flags) == 2
            err = capsys.readouterr().err
            assert f"error: {msg}" in err and "Traceback" not in err, err
    cli.check_listen("127.0.0.1", port)  # free again
    cli.check_listen("127.0.0.1", 0)


def test_the_start_up_line_gives_the_bound_port_and_a_valid_ipv6_url(monkeypatch, caplog):
    """A fresh user's find: started with ``--port 0`` the server logged "serving ... on http://127.0.0.1:0/v1" (the
    port asked for, not the one bound) and ``--host ::1`` gave ``http://::1:8080/v1`` (not a valid URL). The line
    now comes once the server listens, with the bound port and an IPv6 host in brackets."""
    import asyncio
    import logging
    import types

    from mlx_dflash2.server import app as app_module
    from mlx_dflash2.server import cli

    assert app_module.http_url("::1", 8080) == "http://[::1]:8080"
    assert app_module.http_url("127.0.0.1", 8080) == "http://127.0.0.1:8080"

    async def asgi(scope, receive, send):  # a bare app: the line is the CLI's, not the model's
        if scope["type"] == "lifespan":
            while True:
                message = await receive()
                await send({"type": message["type"] + ".complete"})
                if message["type"] == "lifespan.shutdown":
                    return
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b"ok"})

    engine = types.SimpleNamespace(model=types.SimpleNamespace(name="m", proposer=None, block_size=16))
    monkeypatch.setattr(cli, "build_app", lambda args: (asgi, engine))
    bound = []

    class OneShot(app_module.AppServer):  # stops once started
        async def startup(self, sockets=None):
            await super().startup(sockets=sockets)
            port = self.servers[0].sockets[0].getsockname()[1]
            reply = await asyncio.to_thread(httpx.get, f"{self.url()}/", timeout=10)  # the URL is the server's
            assert port != 0 and reply.text == "ok"
            bound.append(port)
            self.should_exit = True

    monkeypatch.setattr(app_module, "AppServer", OneShot)
    caplog.set_level(logging.INFO, logger="mlx_dflash2.server")
    hosts = ["127.0.0.1"]
    try:
        with socket.socket(socket.AF_INET6) as s6:
            s6.bind(("::1", 0))
        hosts.append("::1")
    except OSError:  # no IPv6 loopback here
        pass
    if "::1" in hosts:
        hosts.append("[::1]")  # as the URL writes it
    assert cli.listen_host("[::1]") == "::1" and cli.listen_host("localhost") == "localhost"
    for host in hosts:
        caplog.clear()
        assert cli.main(["--host", host, "--port", "0"]) == 0
        url = app_module.http_url(cli.listen_host(host), bound[-1])
        lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("serving ")]
        assert lines == [f"serving m (drafter none, block size 16) on {url}/v1"], lines


def test_ctrl_c_while_loading_is_one_line(monkeypatch, capsys):
    """A fresh user's run: Ctrl-C during the model's load printed a KeyboardInterrupt traceback from inside a
    loader; now one line and exit status 130."""
    from mlx_dflash2.server import cli

    def interrupted(args):
        raise KeyboardInterrupt

    monkeypatch.setattr(cli, "build_app", interrupted)
    assert cli.main(["--port", "0"]) == 130  # port 0: whichever port is free (8080 may be taken here)
    assert "interrupted while loading" in capsys.readouterr().err


def test_a_second_ctrl_c_ends_requests_in_flight_with_an_error_not_a_cancelled_handler(smol_f32, caplog):
    """A fresh user's run (session 16): a second Ctrl-C while requests streamed made uvicorn force-quit by
    cancelling the handlers mid-response: streams cut without ``[DONE]``, a waiting non-streamed request got
    uvicorn's plain-text 500 and the log CancelledError tracebacks. Now (``AppServer``) every request in flight
    ends with a 503 ``server_shutdown`` error: a stream with an error event and ``[DONE]``, a plain request
    with a JSON body; nothing is logged as an exception."""
    import logging

    from mlx_dflash2.server.app import AppServer

    target, tokenizer = smol_f32
    p = make_proposer("lookup", target, tokenizer, MODEL_ID)
    model = SpeculativeModel(target, p, p.block_size, MODEL_ID, target.config)
    engine = Engine(model, tokenizer, EngineConfig(max_context=MAX_CONTEXT, prefill_step_size=64, max_batch=0))
    app = create_app(engine, ServerSettings(model_id=MODEL_ID, max_tokens=400))
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.bind(("127.0.0.1", 0))
    url = f"http://127.0.0.1:{sock.getsockname()[1]}"
    server = AppServer(uvicorn.Config(app, log_level="warning"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    caplog.set_level(logging.ERROR)
    thread.start()
    while not server.started:
        time.sleep(0.02)
    body = {"model": MODEL_ID, "messages": chat_msgs("Write a long story about a lighthouse."), "max_tokens": 400,
            "temperature": 0, "stream": True}
    lines, plain, first = [], {}, threading.Event()

    def streamer():
        with httpx.stream("POST", f"{url}/v1/chat/completions", json=body, timeout=60) as r:
            for line in r.iter_lines():
                if line:
                    lines.append(line)
                if '"content"' in line:
                    first.set()

    def waiter():  # round-robin engine (max_batch 0, decode_concurrency 1): waits behind the stream
        try:
            r = httpx.post(f"{url}/v1/chat/completions", json={**body, "stream": False}, timeout=60)
            plain.update(status=r.status_code, body=r.text)
        except httpx.HTTPError as e:
            plain.update(status=repr(e))

    ts = [threading.Thread(target=streamer), threading.Thread(target=waiter)]
    for t in ts:
        t.start()
    assert first.wait(60)
    deadline = time.time() + 30
    while len(engine._jobs) < 2 and time.time() < deadline:  # the waiting request is in too
        time.sleep(0.02)
    server.should_exit = True   # the first Ctrl-C: graceful, waits for the requests in flight
    time.sleep(0.5)
    server.force_exit = True    # the second: uvicorn's force quit
    for t in ts:
        t.join(30)
    thread.join(30)
    assert not thread.is_alive()
    events = [json.loads(x[6:]) for x in lines if x.startswith("data: {")]
    assert lines[-1] == "data: [DONE]" and events[-1]["error"]["code"] == "server_shutdown", lines[-3:]
    assert plain["status"] == 503 and json.loads(plain["body"])["error"]["code"] == "server_shutdown", plain
    assert not [r for r in caplog.records if r.exc_info], [r.getMessage() for r in caplog.records]


def test_a_failing_warm_up_is_logged_and_the_server_serves(smol_f32, monkeypatch, caplog):
    """The start-up warm-up is an optimisation: if it fails (a review's find: nothing caught it, so any error in it
    kept the server from starting), the engine logs it and serves."""
    import logging

    from mlx_dflash2.batch import SpeculativeBatch

    def broken(self, *a, **kw):
        raise RuntimeError("no kernels today")

    monkeypatch.setattr(SpeculativeBatch, "warm_up", broken)
    target, tokenizer = smol_f32
    p = make_proposer("lookup", target, tokenizer, MODEL_ID)
    model = SpeculativeModel(target, p, p.block_size, MODEL_ID, target.config)
    with caplog.at_level(logging.WARNING, logger="mlx_dflash2.server"):
        engine = Engine(model, tokenizer, EngineConfig(max_context=MAX_CONTEXT, max_batch=4, warmup=True))
        engine.start()  # (the warm-up runs on the worker's thread, before it serves)
    try:
        assert engine._batch is not None and "warm-up failed (RuntimeError: no kernels today)" in caplog.text
        assert engine.healthy and engine.call(lambda: 1) == 1
    finally:
        engine.stop()


def test_the_warm_up_runs_on_the_workers_thread_before_it_serves(smol_f32, monkeypatch):
    """MLX keeps compiled traces per thread (a traced function's first call on a new thread traces it again), so
    the batched rounds' warm-up runs on the generation worker's thread, and ``start`` returns once it is done
    (session 49: the H100 server's drafting rounds took 66-74 ms at 8 rows where the same rounds in one thread took
    12-25 ms)."""
    import threading

    from mlx_dflash2.batch import SpeculativeBatch

    seen = []
    real = SpeculativeBatch.warm_up

    def warm_up(self, *a, **kw):
        seen.append(threading.current_thread())
        return real(self, [2], [1, 2], **{**kw, "prompt_len": 4})

    monkeypatch.setattr(SpeculativeBatch, "warm_up", warm_up)
    target, tokenizer = smol_f32
    p = make_proposer("lookup", target, tokenizer, MODEL_ID)
    model = SpeculativeModel(target, p, p.block_size, MODEL_ID, target.config)
    engine = Engine(model, tokenizer, EngineConfig(max_context=MAX_CONTEXT, max_batch=4, warmup=True))
    assert seen == []  # not on the loading thread
    engine.start()
    try:
        assert seen == [engine._thread]  # done by the time start returned, on the worker's thread
        engine.stop()
        engine.start()  # a restart does not warm up again
        assert len(seen) == 1
    finally:
        engine.stop()


def test_stopping_the_engine_ends_its_start_up_warm_up_and_ctrl_c_before_start_stops_it(smol_f32, monkeypatch):
    """A server stopped while its worker warms up (a Ctrl-C during the app's startup, which waits for the warm-up)
    ends the warm-up at its next batch shape: ``Engine.stop`` sets what the warm-up asks, ``start`` returns, and
    ``AppServer.handle_exit`` (uvicorn's Ctrl-C handler) asks the engine to stop while the server has not started."""
    import signal
    import threading
    import time

    import uvicorn

    from mlx_dflash2.batch import SpeculativeBatch
    from mlx_dflash2.server.app import AppServer

    inside, ended = threading.Event(), []

    def warm_up(self, rows, widths, *, stop=None, **kw):
        inside.set()
        deadline = time.time() + 60
        while not stop() and time.time() < deadline:  # a long warm-up, one shape at a time
            time.sleep(0.01)
        ended.append(stop())
        return {"shapes": 0, "seconds": 0.0}

    monkeypatch.setattr(SpeculativeBatch, "warm_up", warm_up)
    target, tokenizer = smol_f32
    model = SpeculativeModel(target, None, 1, MODEL_ID, target.config)
    engine = Engine(model, tokenizer, EngineConfig(max_context=MAX_CONTEXT, max_batch=4, warmup=True))
    server = AppServer(uvicorn.Config(create_app(engine, ServerSettings(model_id=MODEL_ID)), log_level="warning"))
    starter = threading.Thread(target=engine.start)
    starter.start()
    assert inside.wait(60)
    server.handle_exit(signal.SIGINT, None)  # not started yet: the engine is asked to stop
    starter.join(30)
    assert not starter.is_alive() and ended == [True]
    engine.stop()
    assert not engine.healthy


def test_a_turns_events_are_handed_out_while_the_next_step_waits_for_the_device(srv, rr_srv, monkeypatch):
    """While the batch has rows, the worker hands a turn's events out inside the next step, once that step's
    round is queued and the host is about to wait for the device (``SpeculativeBatch.on_wait``), not before it
    builds the round: the post wakes the HTTP thread, which takes the GIL (session 48: under load the self-pipe's
    ``send`` was the worker's most frequent handoff). Only the turn that empties the batch hands them out at its
    end. Every output stays its solo one."""
    from mlx_dflash2.batch import SpeculativeBatch
    from mlx_dflash2.server import engine as engine_mod

    inside, posts = [False], []
    real_step, real_post = SpeculativeBatch.step, engine_mod.post_all

    def step(self):
        inside[0] = True
        try:
            return real_step(self)
        finally:
            inside[0] = False

    def spy(items):
        posts.append((inside[0], srv.engine._batch.active, len(items)))
        return real_post(items)

    solo = [_solo(rr_srv.url, b) for b in BATCH_REQS]
    monkeypatch.setattr(SpeculativeBatch, "step", step)
    monkeypatch.setattr(engine_mod, "post_all", spy)
    assert _run_together(srv.url, BATCH_REQS) == solo
    assert sum(1 for i, _, _ in posts if i) >= 3, posts
    assert all(active == 0 for i, active, _ in posts if not i), posts


def test_a_stop_landing_while_a_turns_events_wait_hands_them_out_first(smol_f32):
    """The engine stopping while a turn's events wait for the next batched step (``on_wait``) hands them out before
    it fails the requests still running: a request that had finished gets its final chunk (the breaker helper of
    session 48: the worker left its loop with them in the outbox, and that stream hung)."""
    import asyncio

    from mlx_dflash2.server.engine import Failed, Job, TokenOut

    target, tokenizer = smol_f32
    p = make_proposer("lookup", target, tokenizer, MODEL_ID)
    model = SpeculativeModel(target, p, p.block_size, MODEL_ID, target.config)
    engine = Engine(model, tokenizer, EngineConfig(max_context=MAX_CONTEXT, prefill_step_size=64, max_batch=4))
    real = engine._next_turn_waits

    def waits():
        w = real()
        if w and any(isinstance(e, TokenOut) and e.finish_reason for _, e in engine._outbox):
            engine._stopping.set()  # (engine.stop() landing right here)
        return w

    engine._next_turn_waits = waits
    loop = asyncio.new_event_loop()
    a = Job(kind="text", prompt="Once upon a time", max_tokens=3, loop=loop, queue=asyncio.Queue())
    b = Job(kind="text", prompt="The capital of France is", max_tokens=200, loop=loop, queue=asyncio.Queue())

    async def last(job):
        while True:
            ev = await asyncio.wait_for(job.queue.get(), 60)
            if isinstance(ev, Failed) or (isinstance(ev, TokenOut) and ev.finish_reason):
                return ev

    async def both():
        return await asyncio.gather(last(a), last(b))

    engine.start()
    engine.submit(a)
    engine.submit(b)
    try:
        ea, eb = loop.run_until_complete(both())
    finally:
        engine.stop()
        loop.close()
    assert isinstance(ea, TokenOut) and ea.finish_reason == "length"
    assert isinstance(eb, Failed) and engine._outbox == []


def test_a_steps_logprobs_are_read_with_one_evaluation(monkeypatch):
    """``top_logprobs_many`` (the batched worker's emission of a step's tokens) gives each token what the
    per-token reading gave (its log-probability, the best ``top_n`` sorted) with one evaluation for all, read from
    evaluated arrays: not a scalar's ``.item()`` and two ``.tolist()`` of new ops per token, each an evaluation that
    releases the GIL (session 48)."""
    import mlx.core as mx

    from mlx_dflash2.server.text import top_logprobs_many

    def one_by_one(logprobs, token, top_n):  # the reading before session 48, per token
        lp = float(logprobs[token].item())
        if top_n <= 0:
            return lp, []
        top_n = min(top_n, logprobs.shape[-1])
        idx = mx.argpartition(-logprobs, kth=top_n - 1)[:top_n]
        vals = logprobs[idx]
        return lp, [(int(i), float(v)) for i, v in sorted(zip(idx.tolist(), vals.tolist()), key=lambda p: -p[1])]

    V = 40
    def logprobs(k):
        x = mx.random.normal((V,), key=mx.random.key(k)) * 3
        return x - mx.logsumexp(x)

    items = [(logprobs(k), (7 * k) % V, n) for k, n in enumerate((0, 1, 5, 20, V, 3))]
    want = [one_by_one(*it) for it in items]
    evals = []
    real = mx.eval
    monkeypatch.setattr(mx, "eval", lambda *a, **k: (evals.append(1), real(*a, **k))[1])
    assert top_logprobs_many(items) == want
    assert len(evals) == 1


def test_a_turns_events_reach_their_loop_in_one_wakeup_in_order():
    """The worker hands a turn's events out with one ``call_soon_threadsafe`` per event loop (session 47: a post per
    token woke the HTTP thread at every token, whose self-pipe ``send`` released the GIL mid-emission); each request
    gets its own events in order, and a request whose loop is closed is marked cancelled."""
    import asyncio

    from mlx_dflash2.server.engine import Job, post_all

    class Loop:
        def __init__(self, closed=False):
            self.calls, self.closed = [], closed

        def call_soon_threadsafe(self, fn, *args):
            if self.closed:
                raise RuntimeError("Event loop is closed")
            self.calls.append((fn, args))

    loop, gone = Loop(), Loop(closed=True)
    a, b, c = (Job(kind="text", max_tokens=1, prompt="x", loop=lp, queue=asyncio.Queue()) for lp in (loop, loop, gone))
    post_all([(a, 1), (b, "x"), (a, 2), (c, 0), (a, 3)])
    assert len(loop.calls) == 1
    fn, args = loop.calls[0]
    fn(*args)
    assert [a.queue.get_nowait() for _ in range(3)] == [1, 2, 3] and b.queue.get_nowait() == "x"
    assert c.cancelled and not a.cancelled and not b.cancelled


# ----------------------------------------------------------------------------
# The engine's worker: failures inside a step, start and stop (session 49's breaker helper)
# ----------------------------------------------------------------------------


def _engine(smol_f32, **kw):
    target, tokenizer = smol_f32
    p = make_proposer("lookup", target, tokenizer, MODEL_ID)
    model = SpeculativeModel(target, p, p.block_size, MODEL_ID, target.config)
    return Engine(model, tokenizer, EngineConfig(**{"max_context": MAX_CONTEXT, "prefill_step_size": 64,
                                                   "max_batch": 4, **kw}))


def _run_jobs(engine, specs, timeout=120):
    """Submit jobs (dicts of ``Job`` fields) at once; each job's events up to its last."""
    import asyncio

    from mlx_dflash2.server.engine import Failed, Job, TokenOut

    loop = asyncio.new_event_loop()
    jobs = [Job(loop=loop, queue=asyncio.Queue(), **sp) for sp in specs]

    async def collect(job):
        evs = []
        while True:
            ev = await asyncio.wait_for(job.queue.get(), timeout)
            evs.append(ev)
            if isinstance(ev, Failed) or (isinstance(ev, TokenOut) and ev.finish_reason):
                return evs

    async def gather():
        return await asyncio.gather(*(collect(j) for j in jobs))

    for j in jobs:
        engine.submit(j)
    try:
        return loop.run_until_complete(gather())
    finally:
        loop.close()


_JOBS = [dict(kind="text", prompt="The capital of France is", max_tokens=12),
         dict(kind="text", prompt="List of fruits: apple, banana,", max_tokens=14, gen_kwargs={"stop": ["grape"]})]


def _tokens(evs):
    return [e.token for e in evs if hasattr(e, "token")]


def test_a_failing_logprobs_read_fails_only_the_requests_that_asked_for_them(smol_f32, monkeypatch):
    """The step's log-probabilities are read for every request at once, before the emissions: a failure there fails
    the requests that asked for them, and the others' tokens of that step still go out (they were lost, silently)."""
    from mlx_dflash2.server import engine as engine_mod
    from mlx_dflash2.server.engine import Failed

    solo = _engine(smol_f32, max_batch=0)
    solo.start()
    try:
        want = _run_jobs(solo, _JOBS)
    finally:
        solo.stop()
    real, fired = engine_mod.top_logprobs_many, []

    def flaky(items):
        if not fired and any(n == 7 for _, _, n in items):
            fired.append(1)
            raise RuntimeError("one request's logprobs broke")
        return real(items)

    monkeypatch.setattr(engine_mod, "top_logprobs_many", flaky)
    engine = _engine(smol_f32)
    engine.start()
    try:
        bad = dict(kind="text", prompt="Once upon a time,", max_tokens=10, logprobs=True, top_logprobs=7)
        out = _run_jobs(engine, [bad] + _JOBS)
        assert fired and isinstance(out[0][-1], Failed)
        assert [_tokens(o) for o in out[1:]] == [_tokens(o) for o in want]
        assert engine.metrics.errors == 1 and engine.metrics.completed == 2
    finally:
        engine.stop()


def test_a_failing_prompt_cache_put_does_not_fail_a_finished_request(smol_f32):
    """Keeping a finished request's state is an optimisation: if the prompt cache's put raises, the request still
    ends normally and is counted once (it was counted completed and failed, its last token never sent)."""
    from mlx_dflash2.server.engine import TokenOut

    engine = _engine(smol_f32, prompt_cache_size=8)

    def put(state):
        raise MemoryError("cache full")

    engine.prompt_cache.put = put
    engine.start()
    try:
        out = _run_jobs(engine, _JOBS)
        assert all(isinstance(o[-1], TokenOut) and o[-1].finish_reason for o in out)
        assert (engine.metrics.completed, engine.metrics.errors) == (2, 0)
    finally:
        engine.stop()


def _slow_warm_up(monkeypatch, seconds, exc=None):
    import time

    from mlx_dflash2.batch import SpeculativeBatch

    def warm_up(self, *a, **kw):
        time.sleep(seconds)
        if exc is not None:
            raise exc
        return {"shapes": 0, "seconds": seconds}

    monkeypatch.setattr(SpeculativeBatch, "warm_up", warm_up)


def test_a_start_after_a_stop_that_timed_out_during_the_warm_up_serves(smol_f32, monkeypatch):
    """``stop`` while the worker warms up returns when its join times out, the worker still running; a ``start``
    then waits for that worker to end and starts a new one (it returned at once, and the old worker, stopping,
    left an engine that served nothing)."""
    import threading
    import time

    from mlx_dflash2.server.engine import TokenOut

    _slow_warm_up(monkeypatch, 2.0)
    engine = _engine(smol_f32, warmup=True)
    t = threading.Thread(target=engine.start)
    t.start()
    time.sleep(0.5)
    engine.stop(timeout=0.2)
    assert engine._thread.is_alive()
    engine.start()
    t.join()
    try:
        assert engine.healthy
        assert isinstance(_run_jobs(engine, _JOBS[:1], timeout=60)[0][-1], TokenOut)
    finally:
        engine.stop()


def test_the_first_start_does_not_fail_while_a_second_one_replaces_its_stopped_worker(smol_f32, monkeypatch):
    """The first ``start`` waits for its worker; a ``stop`` ends that worker during the warm-up and a second ``start``
    replaces it: the first one saw the old worker ended and the stop cleared before the new worker was in place, and
    raised "the generation worker ended while it started" (clean-clone CI, session 50: a thread's exception in
    the test above). The window is widened here: the new start's ``clear`` of the stop takes 0.6 s."""
    import threading
    import time

    _slow_warm_up(monkeypatch, 2.0)
    engine = _engine(smol_f32, warmup=True)
    errors = []

    def first():
        try:
            engine.start()
        except Exception as e:  # noqa: BLE001
            errors.append(e)

    t = threading.Thread(target=first)
    t.start()
    time.sleep(0.5)

    class SlowClear(threading.Event):
        def clear(self):
            super().clear()
            time.sleep(0.6)

    slow = SlowClear()
    slow.set()
    engine.stop(timeout=0.2)
    engine._stopping = slow  # (set, as the stop left it)
    engine.start()
    t.join()
    try:
        assert errors == [] and engine.healthy
    finally:
        engine.stop()


def test_a_second_start_waits_for_the_first_ones_warm_up(smol_f32, monkeypatch):
    import threading
    import time

    _slow_warm_up(monkeypatch, 1.5)
    engine = _engine(smol_f32, warmup=True)
    t = threading.Thread(target=engine.start)
    t.start()
    time.sleep(0.3)
    engine.start()
    try:
        assert engine._ready.is_set() and engine.healthy
    finally:
        t.join()
        engine.stop()


@pytest.mark.filterwarnings("ignore::pytest.PytestUnhandledThreadExceptionWarning")
def test_start_raises_when_the_worker_ends_before_it_serves(smol_f32, monkeypatch):
    """A warm-up error that is not an ``Exception`` ends the worker: ``start`` says so (it returned normally, and
    requests waited for a worker that was gone)."""
    _slow_warm_up(monkeypatch, 0.0, SystemExit(3))
    engine = _engine(smol_f32, warmup=True)
    with pytest.raises(RuntimeError, match=r"ended while it started \(SystemExit: 3\)"):
        engine.start()
    assert not engine.healthy
