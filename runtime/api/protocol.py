"""The OpenAI API as xpod speaks it: request checks and the chat template. Pure code: no sockets,
no engine (the HTTP server is `runtime.api.server`; the responses are rendered by
`runtime.engine.render`, in the engine's output processes).

Endpoints (`POST`, JSON body): `/v1/completions` and `/v1/chat/completions`. Every check
failure is an `APIError` that renders as OpenAI's error body
`{"error": {"message", "type", "param", "code"}}` with a 4xx status.

Fields accepted (others are ignored, as OpenAI's own server and vLLM do; fields that would
change the output but are not implemented are refused by name when not at their default):
- `model`: the served model id (`xpod-<preset>` by default; 404 `model_not_found` otherwise;
  missing = the served model, as in vLLM).
- `prompt` (completions): a non-empty string (byte tokens after BOS), or a list of token ids,
  or a list with one of either. `messages` (chat): see `chat_prompt`.
- `max_tokens` (completions: default 16), `max_completion_tokens` / `max_tokens` (chat: default
  the rest of the context); prompt + max_tokens must fit the context (400
  `context_length_exceeded`).
- `temperature` in [0, 2] (default 1; 0 = greedy), `seed` (default: a random one), `stop` (a
  string or up to 16 strings: generation ends before the first occurrence, which is not
  returned), `stop_token_ids`, `ignore_eos`, `n` = 1, `stream`, `stream_options.include_usage`,
  `return_token_ids` (vLLM's extension: the generated token ids in each choice / chunk; byte
  tokens do not survive UTF-8 decoding, so this is how a client sees the exact tokens),
  `cache_salt` (vLLM's: a string of 1 to 256 characters; requests share cached prompt KV,
  die-local or in the KV pool, only with requests of the same salt; none: the default).
The usage reports `prompt_tokens_details.cached_tokens`: the prompt tokens not computed (a
die-local prefix-cache hit or a KV pool load).
"""

from __future__ import annotations

import json
import math
import secrets
import time
from dataclasses import dataclass

from runtime.engine.render import error_body
from runtime.model import encode
from sched import SamplingParams

MAX_STOP_STRINGS = 16
MAX_STOP_LEN = 256
MAX_CACHE_SALT_LEN = 256
CHAT_ROLES = ("system", "developer", "user", "assistant")
# Fields that would change the output: accepted only at these values (OpenAI's defaults).
UNSUPPORTED_DEFAULTS = {
    "top_p": (1, 1.0, None),
    "frequency_penalty": (0, 0.0, None),
    "presence_penalty": (0, 0.0, None),
    "logprobs": (None, False, 0),
    "top_logprobs": (None, 0),
    "best_of": (None, 1),
    "echo": (None, False),
    "suffix": (None, ""),
    "logit_bias": (None, {}),
    "tools": (None, []),
    "response_format": (None, {"type": "text"}),
}


class APIError(Exception):
    """A request the server refuses; `body()` is OpenAI's error object."""

    def __init__(self, status: int, message: str, param: str | None = None,
                 code: str | None = None, type_: str | None = None):  # fmt: skip
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code
        self.type = type_ or ("invalid_request_error" if status < 500 else "server_error")

    def body(self) -> dict:
        return error_body(self.status, self.message, self.code, self.param, self.type)


def bad(message: str, param: str | None = None, code: str | None = None) -> APIError:
    return APIError(400, message, param, code)


@dataclass(frozen=True)
class ModelInfo:
    """What the checks need to know of the served model."""

    name: str
    max_seq_len: int
    vocab_size: int
    created: int = 0

    def card(self) -> dict:
        return {"id": self.name, "object": "model", "created": self.created, "owned_by": "xpod",
                "max_model_len": self.max_seq_len}  # fmt: skip


@dataclass
class ParsedRequest:
    """A checked request: its prompt tokens, sampling parameters and rendering spec."""

    tokens: list[int]
    params: SamplingParams
    render: dict
    cache_salt: str | None = None


# -- checks ------------------------------------------------------------------------------------


def _is_int(v: object) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_number(v: object) -> bool:
    return isinstance(v, int | float) and not isinstance(v, bool)


def _opt_int(body: dict, name: str, lo: int) -> int | None:
    v = body.get(name)
    if v is None:
        return None
    if not _is_int(v):
        raise bad(f"{name} must be an integer, got {json.dumps(v)[:40]}", name, "invalid_type")
    if v < lo:
        raise bad(f"{name} must be >= {lo}, got {v}", name, "invalid_value")
    return v


def _opt_bool(body: dict, name: str) -> bool:
    v = body.get(name, False)
    if v is None:
        return False
    if not isinstance(v, bool):
        raise bad(f"{name} must be a boolean, got {json.dumps(v)[:40]}", name, "invalid_type")
    return v


def check_model(body: dict, model: ModelInfo) -> None:
    name = body.get("model")
    if name is None:
        return
    if not isinstance(name, str):
        raise bad("model must be a string", "model", "invalid_type")
    if name != model.name:
        raise APIError(404, f"The model `{name}` does not exist. This server serves"
                       f" `{model.name}`.", "model", "model_not_found")  # fmt: skip


def _common(body: dict, model: ModelInfo, kind: str) -> dict:
    """The fields both endpoints share; returns the parts of the render spec they set."""
    if not isinstance(body, dict):
        raise bad("the request body must be a JSON object", None, "invalid_body")
    check_model(body, model)
    for name, allowed in UNSUPPORTED_DEFAULTS.items():
        if name in body and body[name] not in allowed:
            raise bad(f"{name} is not supported by xpod (leave it at its default)", name,
                      "unsupported_parameter")  # fmt: skip
    n = body.get("n", 1)
    if n is not None and (not _is_int(n) or n != 1):
        if not _is_int(n):
            raise bad("n must be an integer", "n", "invalid_type")
        raise bad(f"n must be 1 (xpod returns one choice), got {n}", "n", "invalid_value")
    stream = _opt_bool(body, "stream")
    opts = body.get("stream_options")
    include_usage = False
    if opts is not None:
        if not stream:
            raise bad("stream_options is only allowed when stream is true", "stream_options",
                      "invalid_value")  # fmt: skip
        if not isinstance(opts, dict):
            raise bad("stream_options must be an object", "stream_options", "invalid_type")
        include_usage = _opt_bool(opts, "include_usage")
    stop = body.get("stop")
    if stop is None:
        stop = []
    elif isinstance(stop, str):
        stop = [stop]
    if not isinstance(stop, list) or not all(isinstance(s, str) for s in stop):
        raise bad("stop must be a string or a list of strings", "stop", "invalid_type")
    if len(stop) > MAX_STOP_STRINGS:
        raise bad(f"stop: at most {MAX_STOP_STRINGS} strings, got {len(stop)}", "stop",
                  "invalid_value")  # fmt: skip
    if any(not s or len(s) > MAX_STOP_LEN for s in stop):
        raise bad(f"stop: every string must have 1 to {MAX_STOP_LEN} characters", "stop",
                  "invalid_value")  # fmt: skip
    return {"kind": kind, "model": model.name, "created": int(time.time()), "stream": stream,
            "include_usage": include_usage, "stop": stop,
            "return_token_ids": _opt_bool(body, "return_token_ids")}  # fmt: skip


def _sampling(body: dict, model: ModelInfo, max_tokens: int) -> SamplingParams:
    t = body.get("temperature", 1.0)
    if t is None:
        t = 1.0
    if not _is_number(t):
        raise bad("temperature must be a number", "temperature", "invalid_type")
    if not math.isfinite(t) or not 0 <= t <= 2:
        raise bad(f"temperature must be in [0, 2], got {t}", "temperature", "invalid_value")
    seed = body.get("seed")
    if seed is None:
        seed = secrets.randbelow(1 << 31)
    elif not _is_int(seed):
        raise bad("seed must be an integer", "seed", "invalid_type")
    elif not 0 <= seed < 1 << 63:
        raise bad(f"seed must be in [0, 2**63), got {seed}", "seed", "invalid_value")
    ids = body.get("stop_token_ids") or []
    if not isinstance(ids, list) or not all(_is_int(i) for i in ids):
        raise bad("stop_token_ids must be a list of integers", "stop_token_ids", "invalid_type")
    if any(not 0 <= i < model.vocab_size for i in ids):
        raise bad(f"stop_token_ids must be in [0, {model.vocab_size})", "stop_token_ids",
                  "invalid_value")  # fmt: skip
    ignore_eos = _opt_bool(body, "ignore_eos")
    return SamplingParams(max_tokens=max_tokens, temperature=float(t), seed=seed,
                          stop_token_ids=tuple(ids), ignore_eos=ignore_eos)  # fmt: skip


def _context(n_prompt: int, max_tokens: int | None, model: ModelInfo, param: str) -> int:
    """max_tokens checked against the context (None: what is left of it)."""
    limit = model.max_seq_len
    if max_tokens is None:
        if n_prompt >= limit:
            raise bad(f"This model's maximum context length is {limit} tokens. However, your"
                      f" {param} has {n_prompt} tokens, which leaves no room for a completion.",
                      param, "context_length_exceeded")  # fmt: skip
        return limit - n_prompt
    if n_prompt + max_tokens > limit:
        raise bad(f"This model's maximum context length is {limit} tokens. However, you"
                  f" requested {n_prompt + max_tokens} tokens ({n_prompt} in the {param},"
                  f" {max_tokens} in the completion). Please reduce the length of the {param}"
                  " or completion.", param, "context_length_exceeded")  # fmt: skip
    return max_tokens


def parse_completion(body: dict, model: ModelInfo) -> ParsedRequest:
    """A `/v1/completions` body -> ParsedRequest, or APIError."""
    render = _common(body, model, "completion")
    if "prompt" not in body or body["prompt"] is None:
        raise bad("prompt is required", "prompt", "missing_required_parameter")
    prompt = body["prompt"]
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str | list):
        prompt = prompt[0]  # a batch of one
    if isinstance(prompt, str):
        if not prompt:
            raise bad("prompt must not be empty", "prompt", "invalid_value")
        tokens = encode(prompt)
    elif isinstance(prompt, list) and prompt and all(_is_int(t) for t in prompt):
        if any(not 0 <= t < model.vocab_size for t in prompt):
            raise bad(f"prompt: token ids must be in [0, {model.vocab_size})", "prompt",
                      "invalid_value")  # fmt: skip
        tokens = list(prompt)
    elif (
        isinstance(prompt, list)
        and len(prompt) > 1
        and all(isinstance(p, str | list) for p in prompt)
    ):
        raise bad("xpod takes one prompt per request (send a batch as separate requests)",
                  "prompt", "invalid_value")  # fmt: skip
    else:
        raise bad("prompt must be a non-empty string or a non-empty list of token ids",
                  "prompt", "invalid_type")  # fmt: skip
    max_tokens = _opt_int(body, "max_tokens", 1)
    max_tokens = _context(len(tokens), 16 if max_tokens is None else max_tokens, model, "prompt")
    return ParsedRequest(tokens, _sampling(body, model, max_tokens), render, _salt(body))


def _salt(body: dict) -> str | None:
    v = body.get("cache_salt")
    if v is None:
        return None
    if not isinstance(v, str):
        raise bad(f"cache_salt must be a string, got {json.dumps(v)[:40]}", "cache_salt",
                  "invalid_type")  # fmt: skip
    if not v or len(v) > MAX_CACHE_SALT_LEN:
        raise bad(f"cache_salt must have 1 to {MAX_CACHE_SALT_LEN} characters, got {len(v)}",
                  "cache_salt", "invalid_value")  # fmt: skip
    return v


def chat_prompt(messages: object) -> str:
    """The chat template over the byte tokenizer (documented in the README):

    ```
    <|system|>\\n{content}\\n<|user|>\\n{content}\\n ... <|assistant|>\\n
    ```
    every message as `<|role|>`, a newline, its text and a newline; then `<|assistant|>` and a
    newline to prompt the reply. Content is a string or a list of `{"type": "text", "text"}`
    parts (joined). APIError for anything else.
    """
    if not isinstance(messages, list) or not messages:
        raise bad("messages must be a non-empty list", "messages", "invalid_value")
    out = []
    for i, m in enumerate(messages):
        where = f"messages[{i}]"
        if not isinstance(m, dict):
            raise bad(f"{where} must be an object", where, "invalid_type")
        role = m.get("role")
        if role not in CHAT_ROLES:
            raise bad(f"{where}.role must be one of {', '.join(CHAT_ROLES)}, got"
                      f" {json.dumps(role)[:40]}", f"{where}.role", "invalid_value")  # fmt: skip
        content = m.get("content")
        if isinstance(content, list):
            parts = []
            for j, p in enumerate(content):
                if not (isinstance(p, dict) and p.get("type") == "text"
                        and isinstance(p.get("text"), str)):  # fmt: skip
                    raise bad(f"{where}.content[{j}]: only text parts are supported",
                              f"{where}.content", "invalid_value")  # fmt: skip
                parts.append(p["text"])
            content = "".join(parts)
        elif content is None and role == "assistant":
            content = ""
        if not isinstance(content, str):
            raise bad(f"{where}.content must be a string or a list of text parts",
                      f"{where}.content", "invalid_type")  # fmt: skip
        out.append(f"<|{role}|>\n{content}\n")
    out.append("<|assistant|>\n")
    return "".join(out)


def parse_chat(body: dict, model: ModelInfo) -> ParsedRequest:
    """A `/v1/chat/completions` body -> ParsedRequest, or APIError."""
    render = _common(body, model, "chat")
    if "messages" not in body or body["messages"] is None:
        raise bad("messages is required", "messages", "missing_required_parameter")
    tokens = encode(chat_prompt(body["messages"]))
    max_tokens = _opt_int(body, "max_completion_tokens", 1)
    if max_tokens is None:
        max_tokens = _opt_int(body, "max_tokens", 1)
    max_tokens = _context(len(tokens), max_tokens, model, "messages")
    return ParsedRequest(tokens, _sampling(body, model, max_tokens), render, _salt(body))


def request_id(kind: str) -> str:
    return ("chatcmpl-" if kind == "chat" else "cmpl-") + secrets.token_hex(12)
