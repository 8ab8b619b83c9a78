"""The OpenAI API: request checks and chat template (runtime.api.protocol), rendering
(runtime.engine.render.Renderer, runtime.engine.output.OutputHandler).

Pure tests, no processes: bad requests (status, param, code), the accepted forms and defaults,
and property tests of the rendering of byte-token deltas into SSE chunks or a JSON body (UTF-8
holdback, stop strings, usage, token ids), checked against the official `openai` client's types
and SSE decoder.
"""

from __future__ import annotations

import json

import pytest
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st
from openai._streaming import SSEDecoder
from openai.types import Completion
from openai.types.chat import ChatCompletion, ChatCompletionChunk

from runtime.api.protocol import (
    APIError,
    ModelInfo,
    chat_prompt,
    parse_chat,
    parse_completion,
    request_id,
)
from runtime.engine.output import OutputHandler
from runtime.engine.render import DONE_FRAME, Renderer
from runtime.model import BOS, EOS, PAD, decode, encode

MODEL = ModelInfo("xpod-test", max_seq_len=64, vocab_size=300)
USER = [{"role": "user", "content": "hi"}]
BASE = {"completion": {"prompt": "hi"}, "chat": {"messages": USER}}
PARSE = {"completion": parse_completion, "chat": parse_chat}
ANY_CODE = object()  # any non-empty code string
# The chat template around one user message, plus BOS: 1 + len("<|user|>\n") + 1 + 14.
CHAT_OVERHEAD = 1 + 9 + 1 + len("<|assistant|>\n")

PROPS = settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.too_slow])


# -- bad requests ----------------------------------------------------------------------------------

# (id, extra body fields, status, param, code): checked by both endpoints.
COMMON_BAD = [
    ("model-unknown", {"model": "gpt-4o"}, 404, "model", "model_not_found"),
    ("model-not-str", {"model": 3}, 400, "model", "invalid_type"),
    ("max_tokens-0", {"max_tokens": 0}, 400, "max_tokens", "invalid_value"),
    ("max_tokens-neg", {"max_tokens": -1}, 400, "max_tokens", "invalid_value"),
    ("max_tokens-float", {"max_tokens": 1.5}, 400, "max_tokens", "invalid_type"),
    ("max_tokens-str", {"max_tokens": "3"}, 400, "max_tokens", "invalid_type"),
    ("max_tokens-bool", {"max_tokens": True}, 400, "max_tokens", "invalid_type"),
    ("temperature-neg", {"temperature": -0.1}, 400, "temperature", "invalid_value"),
    ("temperature-big", {"temperature": 2.5}, 400, "temperature", "invalid_value"),
    ("temperature-str", {"temperature": "hot"}, 400, "temperature", "invalid_type"),
    ("temperature-nan", {"temperature": float("nan")}, 400, "temperature", "invalid_value"),
    ("temperature-inf", {"temperature": float("inf")}, 400, "temperature", "invalid_value"),
    ("temperature-bool", {"temperature": True}, 400, "temperature", "invalid_type"),
    ("n-2", {"n": 2}, 400, "n", "invalid_value"),
    ("n-0", {"n": 0}, 400, "n", "invalid_value"),
    ("n-str", {"n": "1"}, 400, "n", "invalid_type"),
    ("seed-neg", {"seed": -1}, 400, "seed", "invalid_value"),
    ("seed-big", {"seed": 1 << 63}, 400, "seed", "invalid_value"),
    ("seed-str", {"seed": "x"}, 400, "seed", "invalid_type"),
    ("seed-float", {"seed": 1.0}, 400, "seed", "invalid_type"),
    ("stop-int", {"stop": 5}, 400, "stop", "invalid_type"),
    ("stop-list-int", {"stop": ["a", 1]}, 400, "stop", "invalid_type"),
    ("stop-dict", {"stop": {"a": 1}}, 400, "stop", "invalid_type"),
    ("stop-too-many", {"stop": [f"s{i}" for i in range(17)]}, 400, "stop", ANY_CODE),
    ("stop-empty-str", {"stop": ""}, 400, "stop", ANY_CODE),
    ("stop-empty-in-list", {"stop": ["a", ""]}, 400, "stop", ANY_CODE),
    ("stop-too-long", {"stop": ["x" * 257]}, 400, "stop", ANY_CODE),
    ("stop_token_ids-str", {"stop_token_ids": "x"}, 400, "stop_token_ids", "invalid_type"),
    ("stop_token_ids-float", {"stop_token_ids": [1.5]}, 400, "stop_token_ids", "invalid_type"),
    ("stop_token_ids-bool", {"stop_token_ids": [True]}, 400, "stop_token_ids", "invalid_type"),
    ("stop_token_ids-vocab", {"stop_token_ids": [300]}, 400, "stop_token_ids", "invalid_value"),
    ("stop_token_ids-neg", {"stop_token_ids": [-1]}, 400, "stop_token_ids", "invalid_value"),
    ("stream-str", {"stream": "yes"}, 400, "stream", "invalid_type"),
    ("stream_options-no-stream", {"stream_options": {"include_usage": True}}, 400,
     "stream_options", ANY_CODE),
    ("stream_options-stream-false", {"stream": False, "stream_options": {}}, 400,
     "stream_options", ANY_CODE),
    ("stream_options-not-dict", {"stream": True, "stream_options": [1]}, 400, "stream_options",
     "invalid_type"),
    ("ignore_eos-str", {"ignore_eos": "no"}, 400, "ignore_eos", "invalid_type"),
    ("return_token_ids-int", {"return_token_ids": 1}, 400, "return_token_ids", "invalid_type"),
    ("top_p", {"top_p": 0.5}, 400, "top_p", "unsupported_parameter"),
    ("frequency_penalty", {"frequency_penalty": 0.5}, 400, "frequency_penalty",
     "unsupported_parameter"),
    ("presence_penalty", {"presence_penalty": -1}, 400, "presence_penalty",
     "unsupported_parameter"),
    ("logprobs", {"logprobs": True}, 400, "logprobs", "unsupported_parameter"),
    ("logprobs-int", {"logprobs": 3}, 400, "logprobs", "unsupported_parameter"),
    ("top_logprobs", {"top_logprobs": 2}, 400, "top_logprobs", "unsupported_parameter"),
    ("best_of", {"best_of": 2}, 400, "best_of", "unsupported_parameter"),
    ("echo", {"echo": True}, 400, "echo", "unsupported_parameter"),
    ("suffix", {"suffix": "x"}, 400, "suffix", "unsupported_parameter"),
    ("logit_bias", {"logit_bias": {"65": 10}}, 400, "logit_bias", "unsupported_parameter"),
    ("tools", {"tools": [{"type": "function"}]}, 400, "tools", "unsupported_parameter"),
    ("response_format", {"response_format": {"type": "json_object"}}, 400, "response_format",
     "unsupported_parameter"),
]  # fmt: skip

_DROP = object()  # a field set to this is removed from the body

COMPLETION_BAD = [
    ("prompt-missing", {"prompt": _DROP}, "prompt", "missing_required_parameter"),
    ("prompt-null", {"prompt": None}, "prompt", "missing_required_parameter"),
    ("prompt-empty", {"prompt": ""}, "prompt", "invalid_value"),
    ("prompt-empty-in-batch", {"prompt": [""]}, "prompt", "invalid_value"),
    ("prompt-int", {"prompt": 5}, "prompt", "invalid_type"),
    ("prompt-dict", {"prompt": {"text": "hi"}}, "prompt", "invalid_type"),
    ("prompt-empty-list", {"prompt": []}, "prompt", "invalid_type"),
    ("prompt-empty-token-list", {"prompt": [[]]}, "prompt", "invalid_type"),
    ("prompt-mixed", {"prompt": [1, "a"]}, "prompt", "invalid_type"),
    ("prompt-float-ids", {"prompt": [1.5, 2]}, "prompt", "invalid_type"),
    ("prompt-bool-ids", {"prompt": [True]}, "prompt", "invalid_type"),
    ("prompt-id-vocab", {"prompt": [1, 300]}, "prompt", "invalid_value"),
    ("prompt-id-neg", {"prompt": [-1]}, "prompt", "invalid_value"),
    ("prompt-id-vocab-batch", {"prompt": [[1, 300]]}, "prompt", "invalid_value"),
    ("prompt-batch-str", {"prompt": ["a", "b"]}, "prompt", "invalid_value"),
    ("prompt-batch-ids", {"prompt": [[1], [2]]}, "prompt", "invalid_value"),
    ("context-max_tokens", {"prompt": "a" * 40, "max_tokens": 30}, "prompt",
     "context_length_exceeded"),
    ("context-default-16", {"prompt": "a" * 60}, "prompt", "context_length_exceeded"),
    ("context-ids", {"prompt": list(range(64)), "max_tokens": 1}, "prompt",
     "context_length_exceeded"),
]  # fmt: skip

CHAT_BAD = [
    ("messages-missing", {"messages": _DROP}, "messages", "missing_required_parameter"),
    ("messages-null", {"messages": None}, "messages", "missing_required_parameter"),
    ("messages-str", {"messages": "hi"}, "messages", "invalid_value"),
    ("messages-dict", {"messages": {"role": "user", "content": "hi"}}, "messages",
     "invalid_value"),
    ("messages-empty", {"messages": []}, "messages", "invalid_value"),
    ("message-not-dict", {"messages": ["hi"]}, "messages[0]", "invalid_type"),
    ("role-bad", {"messages": [{"role": "tool", "content": "x"}]}, "messages[0].role",
     "invalid_value"),
    ("role-missing", {"messages": [{"content": "x"}]}, "messages[0].role", "invalid_value"),
    ("role-bad-second", {"messages": [*USER, {"role": "bot", "content": "x"}]},
     "messages[1].role", "invalid_value"),
    ("content-image", {"messages": [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": "http://x/y.png"}}]}]},
     "messages[0].content", "invalid_value"),
    ("content-text-not-str", {"messages": [{"role": "user", "content": [
        {"type": "text", "text": 5}]}]}, "messages[0].content", "invalid_value"),
    ("content-int", {"messages": [{"role": "user", "content": 5}]}, "messages[0].content",
     "invalid_type"),
    ("content-null-user", {"messages": [{"role": "user", "content": None}]},
     "messages[0].content", "invalid_type"),
    ("content-missing", {"messages": [{"role": "system"}]}, "messages[0].content",
     "invalid_type"),
    ("max_completion_tokens-0", {"max_completion_tokens": 0}, "max_completion_tokens",
     "invalid_value"),
    ("max_completion_tokens-str", {"max_completion_tokens": "8"}, "max_completion_tokens",
     "invalid_type"),
    ("context-fills", {"messages": [{"role": "user", "content": "a" * (64 - CHAT_OVERHEAD)}]},
     "messages", "context_length_exceeded"),
    ("context-max_tokens", {"messages": [{"role": "user", "content": "a" * 30}],
                            "max_tokens": 10}, "messages", "context_length_exceeded"),
    ("context-max_completion_tokens", {"messages": [{"role": "user", "content": "a" * 30}],
                                       "max_completion_tokens": 10}, "messages",
     "context_length_exceeded"),
]  # fmt: skip

BAD_CASES = [
    pytest.param(kind, extra, status, param, code, id=f"{kind}-{name}")
    for kind in ("completion", "chat")
    for name, extra, status, param, code in COMMON_BAD
]
BAD_CASES += [
    pytest.param("completion", extra, 400, param, code, id=f"completion-{name}")
    for name, extra, param, code in COMPLETION_BAD
]
BAD_CASES += [
    pytest.param("chat", extra, 400, param, code, id=f"chat-{name}")
    for name, extra, param, code in CHAT_BAD
]


def _body(kind: str, extra: dict) -> dict:
    body = {"model": MODEL.name, **BASE[kind], **extra}
    return {k: v for k, v in body.items() if v is not _DROP}


def _check_error(e: APIError, status: int, param: str | None, code) -> None:
    assert e.status == status, e.message
    assert e.param == param, e.message
    if code is ANY_CODE:
        assert isinstance(e.code, str) and e.code, f"no error code for: {e.message}"
    else:
        assert e.code == code, e.message
    body = e.body()
    assert list(body) == ["error"]
    err = body["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert err["type"] == "invalid_request_error"
    assert isinstance(err["message"], str) and err["message"]
    assert (err["param"], err["code"]) == (e.param, e.code)
    json.dumps(body, allow_nan=False)  # a valid JSON body


@pytest.mark.parametrize(("kind", "extra", "status", "param", "code"), BAD_CASES)
def test_bad_request(kind, extra, status, param, code):
    with pytest.raises(APIError) as ei:
        PARSE[kind](_body(kind, extra), MODEL)
    _check_error(ei.value, status, param, code)


@pytest.mark.parametrize("kind", ["completion", "chat"])
@pytest.mark.parametrize("body", [[], "prompt", None, 3, [{"prompt": "hi"}]])
def test_body_not_a_dict(kind, body):
    with pytest.raises(APIError) as ei:
        PARSE[kind](body, MODEL)
    _check_error(ei.value, 400, None, "invalid_body")


def test_api_error_5xx_type():
    e = APIError(500, "boom", code="engine_error")
    assert e.body() == {"error": {"message": "boom", "type": "server_error", "param": None,
                                  "code": "engine_error"}}  # fmt: skip


# -- accepted requests -----------------------------------------------------------------------------


def test_prompt_forms():
    s = parse_completion({"model": MODEL.name, "prompt": "hé"}, MODEL)
    assert s.tokens == [BOS, *"hé".encode()]
    assert parse_completion({"prompt": ["hé"]}, MODEL).tokens == s.tokens
    assert parse_completion({"prompt": [5, 299, 0]}, MODEL).tokens == [5, 299, 0]
    assert parse_completion({"prompt": [[5, 6]]}, MODEL).tokens == [5, 6]
    assert parse_completion({"prompt": [BOS, EOS, PAD]}, MODEL).tokens == [BOS, EOS, PAD]


def test_completion_defaults():
    req = parse_completion({"prompt": "hi"}, MODEL)  # no model: the served one
    p = req.params
    assert p.max_tokens == 16
    assert p.temperature == 1.0 and isinstance(p.temperature, float)
    assert 0 <= p.seed < 1 << 31
    assert p.stop_token_ids == () and p.ignore_eos is False
    p.validate(MODEL.vocab_size)
    r = req.render
    assert r["kind"] == "completion" and r["model"] == MODEL.name
    assert r["stream"] is False and r["include_usage"] is False
    assert r["stop"] == [] and r["return_token_ids"] is False
    assert isinstance(r["created"], int) and r["created"] > 0


def test_explicit_nulls_are_defaults():
    body = {"prompt": "hi", "model": None, "max_tokens": None, "temperature": None, "n": None,
            "seed": None, "stop": None, "stop_token_ids": None, "stream": None, "top_p": None,
            "logprobs": None, "echo": None, "ignore_eos": None}  # fmt: skip
    req = parse_completion(body, MODEL)
    assert req.params.max_tokens == 16 and req.params.temperature == 1.0
    assert req.render["stop"] == [] and req.render["stream"] is False


def test_completion_fields():
    body = {"model": MODEL.name, "prompt": [1, 2, 3], "max_tokens": 61, "temperature": 0,
            "seed": 7, "stop": "\n", "stop_token_ids": [EOS, 0, 299], "ignore_eos": True,
            "n": 1, "stream": True, "stream_options": {"include_usage": True},
            "return_token_ids": True, "top_p": 1, "logprobs": None, "echo": False,
            "best_of": 1, "frequency_penalty": 0, "presence_penalty": 0.0, "suffix": None,
            "user": "ignored", "metadata": {"x": 1}}  # fmt: skip
    req = parse_completion(body, MODEL)
    p = req.params
    assert (p.max_tokens, p.temperature, p.seed) == (61, 0.0, 7)
    assert p.stop_token_ids == (EOS, 0, 299) and p.ignore_eos is True
    p.validate(MODEL.vocab_size)
    r = req.render
    assert r["stream"] is True and r["include_usage"] is True
    assert r["stop"] == ["\n"] and r["return_token_ids"] is True
    assert parse_completion({"prompt": "hi", "stop": ["a", "bc"]}, MODEL).render["stop"] == [
        "a",
        "bc",
    ]
    sixteen = [f"s{i}" for i in range(16)]
    assert parse_completion({"prompt": "hi", "stop": sixteen}, MODEL).render["stop"] == sixteen
    assert parse_completion({"prompt": "hi", "stop": ["x" * 256]}, MODEL).render["stop"]
    assert parse_completion({"prompt": "hi", "temperature": 2}, MODEL).params.temperature == 2.0
    assert parse_completion({"prompt": "hi", "seed": (1 << 63) - 1}, MODEL).params.seed == (
        (1 << 63) - 1
    )


def test_completion_context_edges():
    # prompt + max_tokens == max_seq_len fits
    assert parse_completion({"prompt": list(range(60)), "max_tokens": 4}, MODEL).params
    assert parse_completion({"prompt": "a" * 47}, MODEL).params.max_tokens == 16  # 48 + 16


def test_chat_defaults_and_max_tokens():
    req = parse_chat({"messages": USER}, MODEL)
    n = len(req.tokens)
    assert req.tokens == encode(chat_prompt(USER))
    assert req.params.max_tokens == MODEL.max_seq_len - n
    assert req.render["kind"] == "chat"
    assert parse_chat({"messages": USER, "max_tokens": 5}, MODEL).params.max_tokens == 5
    both = {"messages": USER, "max_tokens": 5, "max_completion_tokens": 7}
    assert parse_chat(both, MODEL).params.max_tokens == 7
    # max_completion_tokens wins even when max_tokens alone would overflow the context
    both = {"messages": USER, "max_tokens": 1000, "max_completion_tokens": 7}
    assert parse_chat(both, MODEL).params.max_tokens == 7
    # one token of context left: the default takes it
    last = [{"role": "user", "content": "a" * (63 - CHAT_OVERHEAD)}]
    req = parse_chat({"messages": last}, MODEL)
    assert len(req.tokens) == 63 and req.params.max_tokens == 1


def test_chat_template():
    msgs = [
        {"role": "system", "content": "Be brief."},
        {"role": "developer", "content": [{"type": "text", "text": "a"},
                                          {"type": "text", "text": "b"}]},
        {"role": "user", "content": "héllo\n"},
        {"role": "assistant", "content": None},
        {"role": "assistant", "content": []},
        {"role": "user", "content": ""},
    ]  # fmt: skip
    assert chat_prompt(msgs) == (
        "<|system|>\nBe brief.\n<|developer|>\nab\n<|user|>\nhéllo\n\n<|assistant|>\n\n"
        "<|assistant|>\n\n<|user|>\n\n<|assistant|>\n"
    )
    assert chat_prompt(USER) == "<|user|>\nhi\n<|assistant|>\n"
    big = ModelInfo(MODEL.name, max_seq_len=1024, vocab_size=300)
    req = parse_chat({"model": MODEL.name, "messages": msgs}, big)
    assert req.tokens == [BOS, *chat_prompt(msgs).encode()]


def test_model_card_and_request_ids():
    card = ModelInfo("xpod-x", 128, 300, created=5).card()
    assert card == {"id": "xpod-x", "object": "model", "created": 5, "owned_by": "xpod",
                    "max_model_len": 128}  # fmt: skip
    a, b = request_id("chat"), request_id("completion")
    assert a.startswith("chatcmpl-") and b.startswith("cmpl-") and a[9:] != b[5:]


# -- rendering helpers -----------------------------------------------------------------------------


def make_renderer(kind: str, **fields) -> Renderer:
    """A Renderer over the render spec `parse_*` gives for the base body plus `fields`."""
    req = PARSE[kind]({"model": MODEL.name, **BASE[kind], **fields}, MODEL)
    return Renderer({**req.render, "id": request_id(kind)}, len(req.tokens))


def run(r: Renderer, chunks: list[list[int]], last: bool = False, reason: str = "length"):
    """Feed `chunks` (stopping at a stop string) then finish: (pieces, index that stopped)."""
    pieces, stopped_at = [], None
    for i, c in enumerate(chunks):
        data, stopped = r.feed(c, last=last and i == len(chunks) - 1)
        assert isinstance(data, bytes)
        pieces.append(data)
        if stopped:
            stopped_at = i
            assert not data  # `finish` sends the rest
            break
    pieces.append(r.finish(reason))
    assert r.finish(reason) == b""  # idempotent
    return pieces, stopped_at


def frames(piece: bytes) -> list[bytes]:
    """The events of bytes that must be whole `data: ...\\n\\n` frames."""
    if not piece:
        return []
    assert piece.endswith(b"\n\n"), piece[-40:]
    out = piece[:-2].split(b"\n\n")
    for f in out:
        assert f.startswith(b"data: "), f[:40]
        assert b"\n" not in f and b"\r" not in f
    return [f[len(b"data: ") :] for f in out]


def stream_events(pieces: list[bytes]) -> list[dict]:
    """Every feed's / finish's bytes are whole frames; the stream ends with one [DONE]."""
    payloads = [p for piece in pieces for p in frames(piece)]
    assert payloads and payloads[-1] == b"[DONE]"
    assert b"[DONE]" not in payloads[:-1]
    assert b"".join(pieces).endswith(DONE_FRAME)
    events = [json.loads(p) for p in payloads[:-1]]
    # the official client's SSE decoder sees the same events
    client = [e.data for e in SSEDecoder().iter_bytes(iter(pieces))]
    assert client[-1] == "[DONE]"
    assert [json.loads(d) for d in client[:-1]] == events
    return events


def choice_events(events: list[dict], include_usage: bool, kind: str) -> list[dict]:
    """Checks the common chunk shape; returns the choices of the content chunks."""
    obj = "chat.completion.chunk" if kind == "chat" else "text_completion"
    head = None
    for e in events:
        assert e["object"] == obj
        assert e["model"] == MODEL.name
        h = (e["id"], e["created"])
        assert head is None or h == head
        head = h
        if kind == "chat":
            ChatCompletionChunk.model_validate(e)
    content = events
    if include_usage:
        assert events[-1]["choices"] == []
        content = events[:-1]
        for e in content:
            assert "usage" in e and e["usage"] is None
    else:
        for e in events:
            assert "usage" not in e
    choices = []
    for e in content:
        assert len(e["choices"]) == 1
        c = e["choices"][0]
        assert c["index"] == 0 and c["logprobs"] is None
        choices.append(c)
    reasons = [c["finish_reason"] for c in choices]
    assert sum(x is not None for x in reasons) == 1, reasons
    assert reasons[-1] is not None
    return choices


def streamed_text(choices: list[dict], kind: str) -> list[str]:
    if kind == "completion":
        return [c["text"] for c in choices]
    assert choices[0]["delta"] == {"role": "assistant", "content": ""}
    for c in choices[1:]:
        assert "role" not in c["delta"]
    return [c["delta"].get("content", "") for c in choices]


def body_of(pieces: list[bytes], kind: str) -> dict:
    assert all(p == b"" for p in pieces[:-1])
    assert not pieces[-1].startswith(b"data:")
    obj = json.loads(pieces[-1])
    if kind == "chat":
        ChatCompletion.model_validate(obj)
        assert obj["object"] == "chat.completion"
    else:
        Completion.model_validate(obj)
        assert obj["object"] == "text_completion"
    assert len(obj["choices"]) == 1
    return obj


def body_text(obj: dict, kind: str) -> str:
    c = obj["choices"][0]
    if kind == "chat":
        assert c["message"]["role"] == "assistant"
        return c["message"]["content"]
    return c["text"]


@st.composite
def chunked(draw, tokens: list[int]) -> list[list[int]]:
    """`tokens` split at random points (empty chunks included)."""
    cuts = sorted(draw(st.lists(st.integers(0, len(tokens)), max_size=len(tokens) + 2)))
    bounds = [0, *cuts, len(tokens)]
    return [tokens[a:b] for a, b in zip(bounds, bounds[1:], strict=False)]


CHARS = st.characters(codec="utf-8", exclude_characters="\ufffd")
TEXT = st.one_of(
    st.text(CHARS, max_size=40),
    st.lists(
        st.sampled_from(["a", "b", " ", "\n", "é", "€", "中", "😀", "𝄞", "\u2028"]), max_size=30
    ).map("".join),  # fmt: skip
)
KINDS = st.sampled_from(["completion", "chat"])


def usage_of(n_prompt: int, n: int, cached: int = 0) -> dict:
    return {"prompt_tokens": n_prompt, "completion_tokens": n, "total_tokens": n_prompt + n,
            "prompt_tokens_details": {"cached_tokens": cached}}  # fmt: skip


# -- rendering: streaming and non-streaming --------------------------------------------------------


@PROPS
@given(data=st.data(), kind=KINDS, text=TEXT, include_usage=st.booleans(), ids=st.booleans(),
       eos=st.booleans(), last=st.booleans())  # fmt: skip
def test_stream_renders_the_text(data, kind, text, include_usage, ids, eos, last):
    tokens = encode(text, bos=False) + ([EOS] if eos else [])
    chunks = data.draw(chunked(tokens))
    fields = {"stream": True, "return_token_ids": ids}
    if include_usage or data.draw(st.booleans()):
        fields["stream_options"] = {"include_usage": include_usage}
    r = make_renderer(kind, **fields)
    pieces, stopped_at = run(r, chunks, last)
    assert stopped_at is None
    events = stream_events(pieces)
    choices = choice_events(events, include_usage, kind)
    texts = streamed_text(choices, kind)
    assert "".join(texts) == text
    for t in texts:
        assert "\ufffd" not in t  # never half a character
    assert choices[-1]["finish_reason"] == "length"
    if include_usage:
        assert events[-1]["usage"] == usage_of(r.n_prompt, len(tokens))
    if ids:
        assert [t for c in choices for t in c.get("token_ids", [])] == tokens
    else:
        assert all("token_ids" not in c for c in choices)


@PROPS
@given(data=st.data(), kind=KINDS, text=TEXT, ids=st.booleans(), eos=st.booleans(),
       reason=st.sampled_from(["length", "stop"]))  # fmt: skip
def test_non_stream_renders_one_body(data, kind, text, ids, eos, reason):
    tokens = encode(text, bos=False) + ([EOS] if eos else [])
    r = make_renderer(kind, return_token_ids=ids)
    pieces, _ = run(r, data.draw(chunked(tokens)), data.draw(st.booleans()), reason)
    obj = body_of(pieces, kind)
    assert body_text(obj, kind) == text
    c = obj["choices"][0]
    assert c["finish_reason"] == reason
    assert obj["usage"] == usage_of(r.n_prompt, len(tokens))
    assert (c.get("token_ids") == tokens) if ids else "token_ids" not in c
    assert obj["id"] == r.spec["id"] and obj["model"] == MODEL.name


@PROPS
@given(data=st.data(), kind=KINDS, stream=st.booleans(),
       tokens=st.lists(st.integers(0, 258), max_size=40))  # fmt: skip
def test_invalid_utf8_renders_like_decode(data, kind, stream, tokens):
    r = make_renderer(kind, stream=stream)
    pieces, _ = run(r, data.draw(chunked(tokens)), data.draw(st.booleans()))
    if stream:
        choices = choice_events(stream_events(pieces), False, kind)
        assert "".join(streamed_text(choices, kind)) == decode(tokens)
    else:
        assert body_text(body_of(pieces, kind), kind) == decode(tokens)


def test_split_character_is_held():
    r = make_renderer("completion", stream=True, return_token_ids=True)
    euro = list("€".encode())
    out, stopped = r.feed(euro[:1])
    assert not stopped
    (ev,) = [json.loads(p) for p in frames(out)]
    assert ev["choices"][0]["text"] == "" and ev["choices"][0]["token_ids"] == euro[:1]
    out, _ = r.feed(euro[1:])
    (ev,) = [json.loads(p) for p in frames(out)]
    assert ev["choices"][0]["text"] == "€" and ev["choices"][0]["token_ids"] == euro[1:]


def test_truncated_character_at_the_end_is_replaced():
    r = make_renderer("completion")
    r.feed([0x61, 0xE2, 0x82])
    obj = json.loads(r.finish("length"))
    assert obj["choices"][0]["text"] == "a\ufffd" == decode([0x61, 0xE2, 0x82])


def test_error_finish():
    r = make_renderer("completion")
    r.feed(encode("ab", bos=False))
    assert json.loads(r.finish("error", "boom")) == {
        "error": {"message": "boom", "type": "server_error", "param": None, "code": "engine_error"}
    }
    r = make_renderer("chat", stream=True, stop="zz")
    r.feed(encode("abz", bos=False))
    payloads = [p for p in frames(r.finish("error", "boom"))]
    assert payloads[-1] == b"[DONE]"
    assert json.loads(payloads[-2])["error"]["message"] == "boom"
    assert all(json.loads(p).get("choices", [{}])[0].get("finish_reason") is None
               for p in payloads[:-2])  # fmt: skip


# -- stop strings ----------------------------------------------------------------------------------


def ref_stop(text: str, stops: list[str]) -> tuple[str, int] | None:
    """(the output text, tokens up to the one completing a stop string) or None: the first
    character after which some stop string occurs; of those occurring then, the earliest."""
    for k in range(1, len(text) + 1):
        head = text[:k]
        found = [head.find(s) for s in stops if s in head]
        if found:
            return head[: min(found)], len(head.encode())
    return None


@st.composite
def text_and_stops(draw):
    text = draw(TEXT.filter(bool))
    stops = []
    for _ in range(draw(st.integers(1, 3))):
        if draw(st.booleans()):
            i = draw(st.integers(0, len(text) - 1))
            j = draw(st.integers(i + 1, min(len(text), i + 6)))
            stops.append(text[i:j])
        else:
            stops.append(draw(st.text(CHARS, min_size=1, max_size=4)))
    return text, stops


@PROPS
@given(data=st.data(), kind=KINDS, ts=text_and_stops(), eos=st.booleans(), last=st.booleans())
def test_stop_strings_stream(data, kind, ts, eos, last):
    text, stops = ts
    tokens = encode(text, bos=False) + ([EOS] if eos else [])
    chunks = data.draw(chunked(tokens))
    r = make_renderer(kind, stream=True, stop=stops, return_token_ids=True,
                      stream_options={"include_usage": True})  # fmt: skip
    pieces, stopped_at = run(r, chunks, last)
    events = stream_events(pieces)
    choices = choice_events(events, True, kind)
    texts = streamed_text(choices, kind)
    ref = ref_stop(text, stops)
    got_ids = [t for c in choices for t in c.get("token_ids", [])]
    if ref is None:  # no stop string occurs: as without stop strings
        assert stopped_at is None
        assert "".join(texts) == text
        assert choices[-1]["finish_reason"] == "length"
        assert events[-1]["usage"]["completion_tokens"] == len(tokens) == len(got_ids)
        return
    prefix, n = ref
    assert "".join(texts) == prefix  # nothing of the stop string was ever sent
    assert choices[-1]["finish_reason"] == "stop"
    # feed reported the stop at the chunk holding the token that completes the stop string
    ends = [sum(len(c) for c in chunks[: i + 1]) for i in range(len(chunks))]
    assert stopped_at == next(i for i, e in enumerate(ends) if e >= n)
    assert events[-1]["usage"]["completion_tokens"] == n == r.n_tokens
    assert got_ids == tokens[:n]
    assert r.feed(tokens[:1] or [0]) == (b"", True)  # tokens after the stop: nothing
    assert r.n_tokens == n


@PROPS
@given(data=st.data(), kind=KINDS, ts=text_and_stops(), ids=st.booleans())
def test_stop_strings_non_stream(data, kind, ts, ids):
    text, stops = ts
    tokens = encode(text, bos=False)
    r = make_renderer(kind, stop=stops, return_token_ids=ids)
    pieces, stopped_at = run(r, data.draw(chunked(tokens)))
    obj = body_of(pieces, kind)
    ref = ref_stop(text, stops)
    c = obj["choices"][0]
    if ref is None:
        assert stopped_at is None
        assert body_text(obj, kind) == text and c["finish_reason"] == "length"
        assert obj["usage"]["completion_tokens"] == len(tokens)
        return
    prefix, n = ref
    assert stopped_at is not None
    assert body_text(obj, kind) == prefix
    assert c["finish_reason"] == "stop"
    assert obj["usage"] == usage_of(r.n_prompt, n)
    assert (c["token_ids"] == tokens[:n]) if ids else "token_ids" not in c


@PROPS
@given(data=st.data(), kind=KINDS, text=TEXT, stops=st.lists(st.text(CHARS, min_size=1,
       max_size=5), min_size=1, max_size=4))  # fmt: skip
def test_stop_string_that_never_occurs_changes_nothing(data, kind, text, stops):
    assume(all(s not in text for s in stops))
    tokens = encode(text, bos=False)
    chunks = data.draw(chunked(tokens))
    for stream in (False, True):
        plain = make_renderer(kind, stream=stream)
        stopping = make_renderer(kind, stream=stream, stop=stops)
        a, _ = run(plain, chunks)
        b, stopped_at = run(stopping, chunks)
        assert stopped_at is None
        if stream:
            ca = choice_events(stream_events(a), False, kind)
            cb = choice_events(stream_events(b), False, kind)
            assert "".join(streamed_text(ca, kind)) == "".join(streamed_text(cb, kind)) == text
            assert ca[-1]["finish_reason"] == cb[-1]["finish_reason"] == "length"
        else:
            oa, ob = body_of(a, kind), body_of(b, kind)
            assert oa["choices"] == ob["choices"] and oa["usage"] == ob["usage"]


@pytest.mark.parametrize(
    ("text", "stops", "out", "n_chars"),
    [
        ("hello world", ["world"], "hello ", 11),
        ("hello world", ["o"], "hell", 5),
        ("hello world", ["world", "o"], "hell", 5),
        ("hello world", ["lo", "he"], "", 2),
        ("hello world", ["o w", "lo"], "hel", 5),
        ("xabc", ["abc", "bc"], "x", 4),  # both end at 'c': the earlier start wins
        ("aaab", ["aab"], "a", 4),
        ("a€b€c", ["€c"], "a€b", 5),
        ("a😀b", ["😀"], "a", 2),
        ("hello", ["xyz"], "hello", None),
    ],
)
def test_stop_string_examples(text, stops, out, n_chars):
    for one_by_one in (True, False):
        tokens = encode(text, bos=False)
        r = make_renderer("completion", stop=stops, stream=True)
        chunks = [[t] for t in tokens] if one_by_one else [tokens]
        pieces, stopped_at = run(r, chunks)
        choices = choice_events(stream_events(pieces), False, "completion")
        assert "".join(streamed_text(choices, "completion")) == out
        if n_chars is None:
            assert stopped_at is None and r.n_tokens == len(tokens)
        else:
            n = len(text[:n_chars].encode())
            assert r.n_tokens == n
            assert stopped_at == (n - 1 if one_by_one else 0)


@pytest.mark.parametrize("reason", ["abort", "length", "error"])
def test_finish_after_a_stop_says_stop(reason):
    r = make_renderer("completion", stop=["c"])
    assert r.feed(encode("abcd", bos=False)) == (b"", True)
    obj = json.loads(r.finish(reason))  # the engine reports the abort (no error text)
    assert obj["choices"][0]["finish_reason"] == "stop" and obj["choices"][0]["text"] == "ab"
    assert obj["usage"]["completion_tokens"] == 3


def test_holdback_streams_what_cannot_start_a_stop_string():
    r = make_renderer("completion", stream=True, stop=["END"])
    sent = []
    for t in encode("abcdEN", bos=False):
        out, stopped = r.feed([t])
        assert not stopped
        sent += [json.loads(p)["choices"][0]["text"] for p in frames(out)]
    assert "".join(sent) == "abcd"  # "EN" is held: it may start "END"
    out, stopped = r.feed(encode("Dx", bos=False))
    assert (out, stopped) == (b"", True)
    choices = choice_events(stream_events([r.finish("length")]), False, "completion")
    assert [c["text"] for c in choices] == [""] and choices[0]["finish_reason"] == "stop"


# -- OutputHandler ---------------------------------------------------------------------------------


def done_rec(rid: int, reason: str = "length", error: str = "") -> list:
    return [rid, reason, 3, 0, error, 0.0, 0.0]


def spec_of(kind: str = "completion", **fields) -> tuple[dict, int]:
    req = PARSE[kind]({"model": MODEL.name, **BASE[kind], **fields}, MODEL)
    return {**req.render, "id": request_id(kind)}, len(req.tokens)


def feed(h: OutputHandler, body: dict) -> tuple[dict, list[int]]:
    """`h.process` of a master's message written with deltas `[id, tokens]`: each gets its
    output index (as a master sends it), and the raw deltas come back without it."""
    n = h.__dict__.setdefault("test_sent", {})
    deltas = []
    for rid, toks in body.get("deltas", ()):
        deltas.append([rid, n.get(rid, 0), toks])
        n[rid] = n.get(rid, 0) + len(toks)
    out, stops = h.process({**body, "deltas": deltas})
    out["deltas"] = [[rid, toks] for rid, _, toks in out["deltas"]]
    out["data"] = [e for e in out["data"] if e[2] or e[3]]  # id-only entries: the ledger's
    return out, stops


def test_output_handler_rendered_and_raw():
    h = OutputHandler()
    spec, n_prompt = spec_of(stream=True)
    h.open(1, spec, n_prompt)
    h.open(2, None, 5)  # not rendered
    ab = encode("ab", bos=False)
    out, stops = feed(h, {"group": 3, "deltas": [[1, ab], [2, [7, 8]]], "done": []})
    assert stops == []
    assert out["group"] == 3 and out["done"] == []
    assert out["deltas"] == [[2, [7, 8]]]
    ((rid, n, data, final, status, *_),) = out["data"]
    assert (rid, n, final, status) == (1, 2, False, 200)
    (ev,) = [json.loads(p) for p in frames(data)]
    assert ev["choices"][0]["text"] == "ab" and ev["choices"][0]["finish_reason"] is None
    done = [done_rec(1), done_rec(2, "stop")]
    out, stops = feed(h, {"group": 3, "deltas": [[1, encode("c", bos=False)]], "done": done})
    assert stops == [] and out["deltas"] == []
    assert out["done"] == [done_rec(1), done_rec(2, "stop")]  # unchanged
    ((rid, n, data, final, status, *_),) = out["data"]  # the last tokens ride with the finish
    assert (rid, n, final, status) == (1, 1, True, 200)
    choices = choice_events(stream_events([data]), False, "completion")
    assert "".join(c["text"] for c in choices) == "c"
    assert choices[-1]["finish_reason"] == "length"
    assert h.renderers == {}


def test_output_handler_non_stream():
    h = OutputHandler()
    spec, n_prompt = spec_of()
    h.open(4, spec, n_prompt)
    out, _ = feed(h, {"deltas": [[4, encode("x", bos=False)]], "done": []})
    assert out["data"] == [] and out["deltas"] == [] and out["group"] == -1
    out, _ = feed(h, {"deltas": [[4, encode("yz", bos=False)]], "done": [done_rec(4)]})
    ((rid, n, data, final, status, *_),) = out["data"]
    assert (rid, n, final, status) == (4, 3, True, 200)
    obj = body_of([data], "completion")
    assert obj["choices"][0]["text"] == "xyz" and obj["usage"] == usage_of(n_prompt, 3)


@pytest.mark.parametrize("same_message", [True, False])
def test_output_handler_stop_string(same_message):
    h = OutputHandler()
    spec, n_prompt = spec_of("chat", stream=True, stop=["STOP"],
                             stream_options={"include_usage": True})  # fmt: skip
    h.open(9, spec, n_prompt)
    toks = encode("hi STOP more", bos=False)
    first = {"deltas": [[9, toks[:8]]], "done": []}  # "hi STOP " : stop at token index 6
    if same_message:
        first["done"] = [done_rec(9, "length")]
    out, stops = feed(h, first)
    assert stops == [9]
    ((rid, n, data, final, status, *_),) = out["data"]
    assert (rid, n, final, status) == (9, 7, True, 200)
    events = stream_events([data])
    choices = choice_events(events, True, "chat")
    assert "".join(streamed_text(choices, "chat")) == "hi "
    assert choices[-1]["finish_reason"] == "stop"
    assert events[-1]["usage"]["completion_tokens"] == 7
    if not same_message:
        # tokens planned before the abort landed are dropped; the abort's finish says "stop"
        out, stops = feed(h, {"deltas": [[9, toks[8:]]], "done": [done_rec(9, "abort")]})
        assert stops == [] and out["deltas"] == [] and out["data"] == []
    assert out["done"] == [[9, "stop", 3, 0, "", 0.0, 0.0]]
    assert 9 not in h.renderers


def test_output_handler_stop_then_error_record():
    h = OutputHandler()
    spec, n_prompt = spec_of(stop=["b"])
    h.open(1, spec, n_prompt)
    out, stops = feed(h, {"deltas": [[1, encode("ab", bos=False)]], "done": []})
    assert stops == [1] and out["data"][0][3] is True
    out, _ = feed(h, {"deltas": [], "done": [done_rec(1, "abort", "killed")]})
    assert out["done"][0][1:5] == ["stop", 3, 0, ""] and out["data"] == []


@pytest.mark.parametrize("stream", [False, True])
def test_output_handler_error(stream):
    h = OutputHandler()
    spec, n_prompt = spec_of(stream=stream)
    h.open(5, spec, n_prompt)
    out, stops = feed(h, {"deltas": [[5, encode("ab", bos=False)]],
                            "done": [done_rec(5, "error", "die 2 failed")]})  # fmt: skip
    assert stops == []
    assert out["done"] == [done_rec(5, "error", "die 2 failed")]
    assert out["data"][-1][3:5] == [True, 500]
    assert sum(e[1] for e in out["data"]) == 2
    data = b"".join(e[2] for e in out["data"])
    if stream:
        payloads = [p for e in out["data"] for p in frames(e[2])]
        assert payloads[-1] == b"[DONE]"
        err = json.loads(payloads[-2])
        assert [json.loads(p)["choices"][0]["text"] for p in payloads[:-2]] == ["ab"]
    else:
        err = json.loads(data)
    assert err == {"error": {"message": "die 2 failed", "type": "server_error", "param": None,
                             "code": "engine_error"}}  # fmt: skip


@PROPS
@given(data=st.data(), kind=KINDS, ts=text_and_stops(), use_stop=st.booleans(),
       stream=st.booleans(), include_usage=st.booleans())  # fmt: skip
def test_output_handler_token_counts(data, kind, ts, use_stop, stream, include_usage):
    text, stops = ts
    tokens = encode(text, bos=False)
    fields = {"stream": stream, "return_token_ids": True}
    if use_stop:
        fields["stop"] = stops
    if stream:
        fields["stream_options"] = {"include_usage": include_usage}
    spec, n_prompt = spec_of(kind, **fields)
    h = OutputHandler()
    h.open(1, spec, n_prompt)
    chunks = data.draw(chunked(tokens))
    # each message: some chunks of request 1 and an unrendered request 2; `done` with the last
    n_msgs = data.draw(st.integers(1, len(chunks)))
    cuts = sorted(data.draw(st.lists(st.integers(0, len(chunks)), min_size=n_msgs - 1,
                                     max_size=n_msgs - 1)))  # fmt: skip
    bounds = [0, *cuts, len(chunks)]
    entries, stops_seen, dones = [], [], []
    for i, (a, b) in enumerate(zip(bounds, bounds[1:], strict=False)):
        deltas = [[1, c] for c in chunks[a:b]] + [[2, [i]]]
        done = [done_rec(1, "length"), done_rec(2)] if b == len(chunks) else []
        out, ended = feed(h, {"group": 0, "deltas": deltas, "done": done})
        assert out["deltas"] == [[2, [i]]]
        entries += out["data"]
        stops_seen += ended
        dones += out["done"]
    assert all(e[0] == 1 and e[4] == 200 for e in entries)
    finals = [e[3] for e in entries]
    assert finals and finals[-1] is True and finals.count(True) == 1
    ref = ref_stop(text, stops) if use_stop else None
    n_expected = len(tokens) if ref is None else ref[1]
    assert stops_seen == ([] if ref is None else [1])
    assert dones[0][1] == ("length" if ref is None else "stop")
    assert dones[1] == done_rec(2)
    assert sum(e[1] for e in entries) == n_expected
    expected_text = text if ref is None else ref[0]
    pieces = [e[2] for e in entries]
    if stream:
        events = stream_events(pieces)
        choices = choice_events(events, include_usage, kind)
        assert "".join(streamed_text(choices, kind)) == expected_text
        assert sum(len(c.get("token_ids", [])) for c in choices) == n_expected
        if include_usage:
            assert events[-1]["usage"] == usage_of(n_prompt, n_expected)
    else:
        assert len(entries) == 1
        obj = body_of(pieces, kind)
        assert body_text(obj, kind) == expected_text
        assert obj["usage"] == usage_of(n_prompt, n_expected)
