"""Rendering a request's tokens as the bytes its HTTP client reads: OpenAI's completion and chat
responses, streamed as Server-Sent Events or whole (`Renderer`). It runs where the tokens arrive:
in the engine's output processes (output shortcutting, 001 4.1) or on the engine's receiver
thread. The request checks that produce a render spec are the API's (`runtime.api.protocol`).

Streaming of byte tokens: a multi-byte UTF-8 character split over steps is held until its last
byte arrives (`codecs` incremental decoder); with stop strings, the last `len(longest stop) - 1`
characters are held until they cannot start one. Invalid bytes become U+FFFD, as in `decode`.
"""

from __future__ import annotations

import codecs
import json

from runtime.model import NUM_BYTE_TOKENS


def error_body(status: int, message: str, code: str | None = None, param: str | None = None,
               type_: str | None = None) -> dict:  # fmt: skip
    """OpenAI's error object `{"error": {"message", "type", "param", "code"}}`; the type is
    "invalid_request_error" below status 500, "server_error" from it, unless given."""
    kind = type_ or ("invalid_request_error" if status < 500 else "server_error")
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


def sse(obj: dict) -> bytes:
    """One Server-Sent Events frame of a JSON object."""
    return b"data: " + json.dumps(obj, ensure_ascii=False, separators=(",", ":")).encode() + b"\n\n"


DONE_FRAME = b"data: [DONE]\n\n"


class Renderer:
    """Turns one request's token deltas into what its client reads.

    `feed(tokens)` takes the next tokens; it returns the bytes to send now (SSE frames when
    streaming, nothing otherwise) and whether a stop string ended the request (the caller then
    aborts it in the engine: abort-as-stop). `finish(reason, error)` returns the last bytes: the
    final chunk, the usage chunk and `[DONE]` when streaming, else the whole JSON response. After
    a stop string, `finish` gives the response with `finish_reason` "stop" whatever the reason
    passed (the engine reports the abort).

    `spec` is the render spec of `parse_*` plus `id` (the response id); `n_prompt` the prompt's
    token count (usage); `cached` the prompt tokens that were not computed (a prefix-cache hit
    or a KV pool load: `usage.prompt_tokens_details.cached_tokens`), set once it is known.
    """

    def __init__(self, spec: dict, n_prompt: int):
        self.spec = spec
        self.n_prompt = n_prompt
        self.cached = 0
        self.kind = spec.get("kind", "completion")
        self.stream = bool(spec.get("stream"))
        self.stops: list[str] = list(spec.get("stop") or [])
        self.holdback = max((len(s) for s in self.stops), default=1) - 1
        self.ids = bool(spec.get("return_token_ids"))
        self.decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
        self.text = ""  # decoded so far (cut at a stop string)
        self.checked = 0  # characters of `text` searched for stop strings
        self.sent = 0  # characters of `text` already sent (streaming)
        self.token_ids: list[int] = []  # tokens counted (cut after a stop string's last)
        self.unsent_ids: list[int] = []
        self.counted = 0  # tokens reported by take_count
        self.stopped = False
        self.finished = False
        self.started = False  # chat: the first chunk (role) was sent
        obj = "chat.completion" if self.kind == "chat" else "text_completion"
        self.object = obj + (".chunk" if self.stream and self.kind == "chat" else "")
        self.head = {"id": spec.get("id", ""), "object": self.object,
                     "created": spec.get("created", 0), "model": spec.get("model", "")}  # fmt: skip

    @property
    def n_tokens(self) -> int:
        return len(self.token_ids)

    def take_count(self) -> int:
        """Tokens counted since the last call (the engine's per-request token count)."""
        n, self.counted = self.n_tokens - self.counted, self.n_tokens
        return n

    def feed(self, tokens: list[int], last: bool = False) -> tuple[bytes, bool]:
        """`last`: `finish` follows at once; its chunk carries these tokens' text."""
        if self.stopped or self.finished or not tokens:
            return b"", self.stopped
        if self.stops:
            for t in tokens:
                self._take([t])
                if self._match():
                    self.stopped = True
                    break
        else:
            self._take(tokens)
        if not self.stream or self.stopped or last:
            return b"", self.stopped  # `finish` sends the rest with the finish reason
        return self._chunk(self._pending(self.holdback), None), False

    def _take(self, tokens: list[int]) -> None:
        data = bytes(t for t in tokens if 0 <= t < NUM_BYTE_TOKENS)
        self.checked = len(self.text)
        self.text += self.decoder.decode(data)
        self.token_ids.extend(tokens)
        self.unsent_ids.extend(tokens)

    def _match(self) -> bool:
        """Cut `text` at the first stop string that ends in the newest characters."""
        start = max(0, self.checked - self.holdback)  # a new match ends in the new text
        best = -1
        for s in self.stops:
            i = self.text.find(s, start)
            if i >= 0 and (best < 0 or i < best):
                best = i
        if best < 0:
            return False
        self.text = self.text[:best]
        return True

    def _pending(self, hold: int) -> str:
        end = max(self.sent, len(self.text) - hold)
        out = self.text[self.sent : end]
        self.sent = end
        return out

    def _chunk(self, text: str, reason: str | None) -> bytes:
        """One streamed chunk (b"" if it would carry nothing at all)."""
        ids, self.unsent_ids = self.unsent_ids, []
        frames = b""
        if self.kind == "chat" and not self.started:
            self.started = True
            frames += sse(self._frame({"role": "assistant", "content": ""}, None, None))
        if not text and not ids and reason is None:
            return frames
        if self.kind == "chat":
            delta = {"content": text} if text or reason is None else {}
            frames += sse(self._frame(delta, reason, ids))
        else:
            frames += sse(self._frame(text, reason, ids))
        return frames

    def _frame(self, content, reason: str | None, ids: list[int] | None) -> dict:
        choice: dict = {"index": 0}
        if self.kind == "chat":
            choice["delta"] = content
        else:
            choice["text"] = content
        choice["logprobs"] = None
        choice["finish_reason"] = reason
        if self.ids and ids is not None:
            choice["token_ids"] = ids
        obj = {**self.head, "choices": [choice]}
        if self.spec.get("include_usage"):
            obj["usage"] = None
        return obj

    def usage(self) -> dict:
        cached = {"cached_tokens": min(self.cached, self.n_prompt)}
        return {"prompt_tokens": self.n_prompt, "completion_tokens": self.n_tokens,
                "total_tokens": self.n_prompt + self.n_tokens,
                "prompt_tokens_details": cached}  # fmt: skip

    def finish(self, reason: str, error: str = "") -> bytes:
        """The last bytes of the response (see the class docstring); idempotent: b"" after."""
        if self.finished:
            return b""
        self.finished = True
        if self.stopped:
            reason = "stop"
        elif not error:
            self.text += self.decoder.decode(b"", final=True)
        if error:
            err = error_body(500, error, "engine_error", type_="server_error")
            if not self.stream:
                return json.dumps(err).encode()
            return self._chunk(self._pending(self.holdback), None) + sse(err) + DONE_FRAME
        if not self.stream:
            choice: dict = {"index": 0}
            if self.kind == "chat":
                choice["message"] = {"role": "assistant", "content": self.text}
            else:
                choice["text"] = self.text
            choice["logprobs"] = None
            choice["finish_reason"] = reason
            if self.ids:
                choice["token_ids"] = self.token_ids
            obj = {**self.head, "choices": [choice], "usage": self.usage()}
            return json.dumps(obj, ensure_ascii=False, separators=(",", ":")).encode()
        out = self._chunk(self._pending(0), reason)
        if self.spec.get("include_usage"):
            out += sse({**self.head, "choices": [], "usage": self.usage()})
        return out + DONE_FRAME
