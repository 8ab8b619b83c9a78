"""`xpod serve`: the OpenAI-compatible HTTP server, end to end through the real processes.

- the official `openai` client: models, completions and chat, streaming and not, usage,
  BadRequestError / NotFoundError with OpenAI's error body;
- a raw HTTP client: SSE framing and `[DONE]`, split UTF-8 never emitted, every bad request
  (each a 4xx with the error body, the server still serving);
- stop strings, stop token ids;
- many concurrent streams equal the schedule replay, bit for bit (an in-process server over an
  engine that logs its steps);
- a client that disconnects mid-stream: its request is aborted and KV usage returns to 0;
- overload: 503 with Retry-After past the admission bound, then recovery;
- /health sees a hung die and a hung master (SIGSTOP) and recovers (SIGCONT);
- SIGTERM under load drains (exit 0), Ctrl-C past --drain-timeout aborts (exit 0), a killed
  die with `--no-recover` makes the server answer errors and exit 1 (with recovery:
  tests/integration/test_reliability.py); nothing is left behind in any case.

Servers run as `xpod serve` subprocesses (tiny model, 2 dies) except the replay one.
"""

from __future__ import annotations

import asyncio
import contextlib
import http.client
import json
import os
import queue
import select
import signal
import socket
import struct
import subprocess
import sys
import threading
import time
import urllib.parse
from pathlib import Path

import aiohttp
import openai
import psutil
import pytest
from conftest import ours  # tests/conftest.py, as pytest imported it
from prometheus_client.parser import text_string_to_metric_families

from runtime.model import EOS, encode
from tests.waiting import stopped, wait_for

ROOT = Path(__file__).resolve().parents[2]
MODEL = "xpod-tiny"
START_S = 60.0


# -- a server subprocess ---------------------------------------------------------------------


def _alive(pids: list[int], within_s: float = 10.0) -> list[int]:
    """The pids still running (not gone, not a zombie) after waiting up to `within_s` for
    them to go: a process that is gone stays gone."""

    def running() -> list[int]:
        out = []
        for p in pids:
            with contextlib.suppress(psutil.NoSuchProcess):
                if psutil.Process(p).status() != psutil.STATUS_ZOMBIE:
                    out.append(p)
        return out

    deadline = time.monotonic() + within_s
    while (left := running()) and time.monotonic() < deadline:
        time.sleep(0.02)
    return left


# A server whose dies a test stops (SIGSTOP) to hold its requests where it wants them: no hang
# detection, no collective deadline (those are tested in test_reliability*.py)
HELD = ("--op-timeout", "60", "--stall-timeout", "60", "--heartbeat-timeout", "60")


class ServerProc:
    """`xpod serve --port 0 ...` in a subprocess; `url` once it serves; `stop()` checks that
    it exits with the expected status and that its processes and segments are gone."""

    def __init__(self, *args: str, dies: int = 2):
        cmd = [sys.executable, "-m", "runtime.cli", "serve", "--port", "0", "--model", "tiny",
               "--dies", str(dies), *args]  # fmt: skip
        self.proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE,
                                     stderr=subprocess.PIPE, text=True)  # fmt: skip
        self.lines: queue.Queue = queue.Queue()
        self.err: list[str] = []
        threading.Thread(target=self._read, args=(self.proc.stdout, self.lines.put),
                         daemon=True).start()  # fmt: skip
        threading.Thread(target=self._read, args=(self.proc.stderr, self.err.append),
                         daemon=True).start()  # fmt: skip
        try:
            self._wait_until_serving()
        except BaseException:
            self.kill()  # a server that started but failed a check must not outlive the test
            raise

    def _wait_until_serving(self) -> None:
        deadline = time.monotonic() + START_S
        self.url = ""
        while not self.url:
            try:
                line = self.lines.get(timeout=max(0.1, deadline - time.monotonic()))
            except queue.Empty:
                raise AssertionError(f"no URL after {START_S} s: {''.join(self.err)}") from None
            if " on http://" in line:
                self.url = line.split(" on ", 1)[1].split()[0]
            if self.proc.poll() is not None and not self.url:
                raise AssertionError(f"xpod serve exited: {''.join(self.err)}")
        u = urllib.parse.urlparse(self.url)
        self.host, self.port = u.hostname, u.port
        self.pids = [c.pid for c in psutil.Process(self.proc.pid).children(recursive=True)]
        self.pods = {n.split(".")[1] for n in _segments() if n.endswith(".ctl")
                     and _launcher(n) == self.proc.pid}  # fmt: skip
        assert self.pods, "the server's pod has no control segment"

    @staticmethod
    def _read(stream, put) -> None:
        for line in stream:
            put(line)

    def kill(self) -> None:
        for pid in [self.proc.pid, *getattr(self, "pids", [])]:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        self.proc.wait(10)

    def send(self, sig: int) -> None:
        self.proc.send_signal(sig)

    def stop(self, sig: int | None = signal.SIGTERM, expect: int = 0,
             timeout_s: float = 30.0) -> str:  # fmt: skip
        """Signal it (unless `sig` is None: it was), wait for its exit; assert the status and
        that nothing is left; returns its stderr."""
        if sig is not None and self.proc.poll() is None:
            self.proc.send_signal(sig)
        try:
            code = self.proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            self.kill()
            raise AssertionError(f"xpod serve did not exit in {timeout_s} s") from None
        err = "".join(self.err)
        left = _alive(self.pids)  # a SIGKILL the server sent may take a moment to land
        segs = {n for n in _segments() if n.split(".")[1] in self.pods}
        assert code == expect, f"exit status {code}, expected {expect}: {err}"
        assert not left, f"processes left: {left}"
        assert not segs, f"segments left: {segs}"
        return err

    # -- requests ------------------------------------------------------------------------------

    def request(self, method: str, path: str, body=None, headers=None, raw: bytes | None = None):
        """(status, headers, body bytes) of one request on a new connection."""
        c = http.client.HTTPConnection(self.host, self.port, timeout=60)
        data = raw if raw is not None else (json.dumps(body).encode() if body is not None
                                            else None)  # fmt: skip
        h = {"Content-Type": "application/json", **(headers or {})}
        c.request(method, path, body=data, headers=h)
        r = c.getresponse()
        out = r.status, dict(r.getheaders()), r.read()
        c.close()
        return out

    def post(self, path: str, body: dict):
        status, headers, data = self.request("POST", path, body)
        return status, headers, data

    def metrics(self) -> dict:
        """{(name, labels as a sorted tuple): value} of /metrics samples."""
        _, _, data = self.request("GET", "/metrics")
        out = {}
        for fam in text_string_to_metric_families(data.decode()):
            for s in fam.samples:
                out[(s.name, tuple(sorted(s.labels.items())))] = s.value
        return out

    def client(self) -> openai.OpenAI:
        return openai.OpenAI(base_url=self.url + "/v1", api_key="x", max_retries=0, timeout=60)


def _segments() -> set[str]:
    return {e for e in os.listdir("/dev/shm") if e.startswith("xpod.")}


def _our_segments() -> set[str]:
    """This test run's xpod segments (its servers' pods once they are gone; not the pods other
    processes run meanwhile)."""
    return {e for e in _segments() if ours(e)}


def _launcher(ctl: str) -> int:
    """The launcher pid a pod's control segment names (0 if unreadable)."""
    try:
        with open(f"/dev/shm/{ctl}", "rb") as f:
            head = f.read(24)
    except OSError:
        return 0
    return struct.unpack("<3q", head)[2] if len(head) == 24 else 0


def metric(m: dict, name: str, **labels) -> float:
    key = (name, tuple(sorted((k, str(v)) for k, v in labels.items())))
    return m.get(key, 0.0)


def sse_events(data: bytes) -> list:
    """The events of an SSE body, checking the framing: `data: ...` events separated by a
    blank line, the last `[DONE]`; JSON events decoded."""
    assert data.endswith(b"\n\n"), data[-80:]
    frames = data[:-2].split(b"\n\n")
    events = []
    for f in frames:
        assert f.startswith(b"data: ") and b"\n" not in f, f[:120]
        payload = f[6:]
        events.append("[DONE]" if payload == b"[DONE]" else json.loads(payload))
    assert events[-1] == "[DONE]" and "[DONE]" not in events[:-1]
    return events[:-1]


@pytest.fixture(scope="module")
def server():
    s = ServerProc("--max-num-seqs", "4", "--max-queue", "4", "--max-body", "64K",
                   "--health-timeout", "2")  # fmt: skip
    try:
        yield s
    finally:
        s.stop()


def settle(server: ServerProc, timeout_s: float = 30.0) -> dict:
    """/metrics once every group is idle with no KV in use (AssertionError if it does not)."""
    deadline = time.monotonic() + timeout_s
    while True:
        m = server.metrics()
        busy = [metric(m, n, group=g) for g in (0, 1) for n in
                ("xpod_num_requests_running", "xpod_num_requests_waiting",
                 "xpod_kv_cache_usage_perc")]  # fmt: skip
        if not any(busy) and not metric(m, "xpod_num_requests_inflight_http"):
            return m
        if time.monotonic() > deadline:
            raise AssertionError(f"the server did not settle: {busy}")
        time.sleep(0.05)


# -- the openai client -------------------------------------------------------------------------


@pytest.mark.timeout(120)
def test_openai_client_models_completions_and_chat(server):
    c = server.client()
    assert [m.id for m in c.models.list()] == [MODEL]
    assert c.models.retrieve(MODEL).id == MODEL
    r = c.completions.create(model=MODEL, prompt="hello pod", max_tokens=7, temperature=0,
                             extra_body={"ignore_eos": True})  # fmt: skip
    assert r.object == "text_completion" and r.model == MODEL and len(r.choices) == 1
    assert r.choices[0].finish_reason == "length"
    assert r.usage.prompt_tokens == len(encode("hello pod")) and r.usage.completion_tokens == 7
    assert r.usage.total_tokens == r.usage.prompt_tokens + 7
    chat = c.chat.completions.create(model=MODEL, max_tokens=5, temperature=0,
                                     messages=[{"role": "system", "content": "be brief"},
                                               {"role": "user", "content": "hi"}],
                                     extra_body={"ignore_eos": True})  # fmt: skip
    msg = chat.choices[0].message
    assert chat.object == "chat.completion" and msg.role == "assistant"
    template = "<|system|>\nbe brief\n<|user|>\nhi\n<|assistant|>\n"
    assert chat.usage.prompt_tokens == len(encode(template)) and chat.usage.completion_tokens == 5
    # streaming, with usage: the same text and tokens as the non-streamed greedy request
    s = c.completions.create(model=MODEL, prompt="hello pod", max_tokens=7, temperature=0,
                             stream=True, stream_options={"include_usage": True},
                             extra_body={"ignore_eos": True})  # fmt: skip
    chunks = list(s)
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 7
    assert "".join(ch.choices[0].text for ch in chunks[:-1]) == r.choices[0].text
    assert [ch.choices[0].finish_reason for ch in chunks[:-1]][-1] == "length"
    cs = c.chat.completions.create(model=MODEL, max_tokens=5, temperature=0, stream=True,
                                   messages=[{"role": "system", "content": "be brief"},
                                             {"role": "user", "content": "hi"}],
                                   extra_body={"ignore_eos": True})  # fmt: skip
    deltas = list(cs)
    assert deltas[0].choices[0].delta.role == "assistant"
    assert "".join(d.choices[0].delta.content or "" for d in deltas) == msg.content
    assert deltas[-1].choices[0].finish_reason == "length"


@pytest.mark.timeout(60)
def test_openai_client_errors_have_the_openai_body(server):
    c = server.client()
    with pytest.raises(openai.NotFoundError) as e:
        c.completions.create(model="gpt-4", prompt="x", max_tokens=2)
    assert e.value.status_code == 404 and e.value.body["code"] == "model_not_found"
    cases = [
        (dict(max_tokens=0), "max_tokens"),
        (dict(max_tokens=2, temperature=-0.5), "temperature"),
        (dict(max_tokens=2, n=2), "n"),
        (dict(max_tokens=250, prompt="x" * 20), "prompt"),  # 21 + 250 > 256 tokens
    ]
    for kw, param in cases:
        kw = {"prompt": "x", **kw}
        with pytest.raises(openai.BadRequestError) as e:
            c.completions.create(model=MODEL, **kw)
        body = e.value.body
        assert set(body) == {"message", "type", "param", "code"}, body
        assert body["param"] == param and body["type"] == "invalid_request_error", body
        assert body["message"]
    with pytest.raises(openai.BadRequestError) as e:
        c.chat.completions.create(model=MODEL, messages=[{"role": "robot", "content": "x"}])
    assert e.value.body["param"] == "messages[0].role"
    r = c.completions.create(model=MODEL, prompt="still serving", max_tokens=2)
    assert r.usage.completion_tokens >= 1


# -- raw HTTP ------------------------------------------------------------------------------------


@pytest.mark.timeout(60)
def test_sse_framing_usage_and_done(server):
    body = {"model": MODEL, "prompt": "frames", "max_tokens": 6, "stream": True,
            "temperature": 0, "ignore_eos": True, "return_token_ids": True,
            "stream_options": {"include_usage": True}}  # fmt: skip
    status, headers, data = server.post("/v1/completions", body)
    assert status == 200 and headers["Content-Type"].startswith("text/event-stream")
    events = sse_events(data)
    usage = events[-1]
    assert usage["choices"] == [] and usage["usage"]["completion_tokens"] == 6
    chunks = events[:-1]
    assert all(e["object"] == "text_completion" and e["usage"] is None for e in chunks)
    assert len({e["id"] for e in events}) == 1
    reasons = [e["choices"][0]["finish_reason"] for e in chunks]
    assert reasons[-1] == "length" and all(r is None for r in reasons[:-1])
    ids = [t for e in chunks for t in e["choices"][0]["token_ids"]]
    assert len(ids) == 6
    # without include_usage: no usage anywhere; chat chunks name their object
    body = {"model": MODEL, "messages": [{"role": "user", "content": "x"}], "max_tokens": 3,
            "stream": True}  # fmt: skip
    status, _, data = server.post("/v1/chat/completions", body)
    events = sse_events(data)
    assert status == 200 and all(e["object"] == "chat.completion.chunk" for e in events)
    assert all("usage" not in e for e in events)
    assert events[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}


@pytest.mark.timeout(120)
def test_split_utf8_is_never_emitted(server):
    """Sampled byte tokens form multi-byte characters now and then; each arrives over several
    steps (one token per chunk), so a chunk that carried half of one would show U+FFFD where
    the whole text has the character."""
    found = 0
    for seed in range(12):
        body = {"model": MODEL, "prompt": "bytes", "max_tokens": 200, "stream": True,
                "temperature": 1.0, "seed": seed, "ignore_eos": True,
                "return_token_ids": True}  # fmt: skip
        status, _, data = server.post("/v1/completions", body)
        assert status == 200
        chunks = sse_events(data)
        ids = [t for e in chunks for t in e["choices"][0]["token_ids"]]
        whole = bytes(t for t in ids if t < 256).decode("utf-8", errors="replace")
        assert "".join(e["choices"][0]["text"] for e in chunks) == whole
        found += sum(1 for ch in whole if ord(ch) > 127 and ch != "\ufffd")
        if found >= 3:
            break
    assert found >= 3, "the samples must hold multi-byte characters for this test to mean much"


def _text(ids: list[int]) -> str:
    return bytes(t for t in ids if t < 256).decode("utf-8", "replace")


def _bad(server: ServerProc, path: str, body=None, raw=None, method="POST"):
    status, headers, data = server.request(method, path, body, raw=raw)
    err = json.loads(data)["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"], err
    return status, err, headers


BAD_COMPLETIONS = [
    ({"prompt": "x", "model": "nope"}, 404, "model_not_found"),
    ({"max_tokens": 3}, 400, "missing_required_parameter"),
    ({"prompt": ""}, 400, "invalid_value"),
    ({"prompt": 5}, 400, "invalid_type"),
    ({"prompt": [1, 2, 99999]}, 400, "invalid_value"),
    ({"prompt": "x", "max_tokens": 0}, 400, "invalid_value"),
    ({"prompt": "x", "max_tokens": -3}, 400, "invalid_value"),
    ({"prompt": "x", "max_tokens": 2.5}, 400, "invalid_type"),
    ({"prompt": "x", "max_tokens": "8"}, 400, "invalid_type"),
    ({"prompt": "x", "temperature": -0.1}, 400, "invalid_value"),
    ({"prompt": "x", "temperature": "warm"}, 400, "invalid_type"),
    ({"prompt": "x", "n": 3}, 400, "invalid_value"),
    ({"prompt": "x", "stop": [""]}, 400, None),
    ({"prompt": "x", "stream_options": {"include_usage": True}}, 400, None),
    ({"prompt": "x", "top_p": 0.5}, 400, "unsupported_parameter"),
    ({"prompt": "x" * 200, "max_tokens": 60}, 400, "context_length_exceeded"),
]


@pytest.mark.timeout(120)
def test_every_bad_request_is_a_4xx_with_the_error_body(server):
    for body, status, code in BAD_COMPLETIONS:
        got, err, _ = _bad(server, "/v1/completions", {"model": MODEL, **body})
        assert got == status, (body, got, err)
        if code:
            assert err["code"] == code, (body, err)
    for body in ({}, {"messages": []}, {"messages": "hi"}, {"messages": [{"role": "user"}]},
                 {"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}):  # fmt: skip
        got, err, _ = _bad(server, "/v1/chat/completions", body)
        assert got == 400 and err["param"].startswith("messages"), (body, err)
    got, err, _ = _bad(server, "/v1/completions", raw=b'{"prompt": "x", ')
    assert got == 400 and err["code"] == "invalid_json"
    got, err, _ = _bad(server, "/v1/completions", raw=b"[1, 2]")
    assert got == 400
    got, err, _ = _bad(server, "/v1/completions", raw=b"\xff\xfe")
    assert got == 400
    got, err, _ = _bad(server, "/v1/completions", raw=b"")
    assert got == 400
    big = json.dumps({"prompt": "x" * (70 << 10)}).encode()  # over --max-body 64K
    got, err, _ = _bad(server, "/v1/completions", raw=big)
    assert got == 413 and err["code"] == "request_too_large"
    got, err, headers = _bad(server, "/v1/completions", method="GET")
    assert got == 405 and "POST" in headers.get("Allow", ""), headers
    got, err, _ = _bad(server, "/v1/nothing", method="GET")
    assert got == 404
    got, err, _ = _bad(server, "/v1/models/nope", method="GET")
    assert got == 404 and err["code"] == "model_not_found"
    # still serving, and nothing of the bad requests reached the engine
    status, _, data = server.post("/v1/completions", {"prompt": "ok", "max_tokens": 2})
    assert status == 200 and json.loads(data)["usage"]["completion_tokens"] >= 1
    settle(server)


# -- stop strings and stop tokens ----------------------------------------------------------------


@pytest.mark.timeout(60)
def test_stop_strings_and_stop_token_ids(server):
    base = {"model": MODEL, "prompt": "the stop test", "max_tokens": 40, "temperature": 0,
            "ignore_eos": True, "return_token_ids": True}  # fmt: skip
    _, _, data = server.post("/v1/completions", base)
    full = json.loads(data)["choices"][0]
    text, ids = full["text"], full["token_ids"]
    # a stop string from the middle of the greedy text: cut before its first occurrence
    ascii_at = [i for i, ch in enumerate(text) if 32 < ord(ch) < 127 and i > 3]
    assert ascii_at, f"the greedy text has no printable character to stop at: {text!r}"
    stop = text[ascii_at[0]]
    cut = text.index(stop)
    for stream in (False, True):
        body = {**base, "stop": [stop, "\x00never"], "stream": stream}
        if stream:
            body["stream_options"] = {"include_usage": True}
        status, _, data = server.post("/v1/completions", body)
        assert status == 200
        if stream:
            ev = sse_events(data)
            got = "".join(e["choices"][0]["text"] for e in ev[:-1])
            reason, usage = ev[-2]["choices"][0]["finish_reason"], ev[-1]["usage"]
        else:
            ch = json.loads(data)
            c0 = ch["choices"][0]
            got, reason, usage = c0["text"], c0["finish_reason"], ch["usage"]
        assert (got, reason) == (text[:cut], "stop"), (stream, got, text, stop)
        # tokens: up to the one that completed the stop string
        k = next(i for i in range(1, len(ids) + 1) if stop in _text(ids[:i]))
        assert usage["completion_tokens"] == k
    # a stop token id: the output ends with it, finish_reason stop
    tok = ids[5]
    status, _, data = server.post("/v1/completions", {**base, "stop_token_ids": [tok]})
    ch = json.loads(data)["choices"][0]
    assert ch["finish_reason"] == "stop" and ch["token_ids"] == ids[: ids.index(tok) + 1]
    # EOS is a stop unless ignore_eos
    status, _, data = server.post("/v1/completions", {**base, "stop_token_ids": [EOS],
                                                      "ignore_eos": False})  # fmt: skip
    assert status == 200
    settle(server)


@pytest.fixture(scope="module")
def interval_server():
    """A server with --stream-interval 4 (its streams) and a 1 s health timeout with no
    recovery (a die or master a test holds is unhealthy, then healthy again): the tests that use
    it leave it serving, nothing held."""
    s = ServerProc("--stream-interval", "4", "--health-timeout", "1", "--timeout", "30",
                   "--no-recover")  # fmt: skip
    try:
        yield s
    finally:
        s.stop()


@pytest.mark.timeout(60)
def test_stream_interval_sends_every_n_tokens(interval_server):
    """--stream-interval 4: the first token at once, then chunks of at least 4 tokens, the rest
    with the finish; the same tokens as one non-streamed response."""
    s = interval_server
    base = {"model": MODEL, "prompt": "interval", "max_tokens": 17, "temperature": 0,
            "ignore_eos": True, "return_token_ids": True}  # fmt: skip
    _, _, data = s.post("/v1/completions", base)
    whole = json.loads(data)["choices"][0]
    status, _, data = s.post("/v1/completions", {**base, "stream": True})
    chunks = sse_events(data)
    sizes = [len(e["choices"][0]["token_ids"]) for e in chunks]
    # the first chunk goes out with the first result the master reads (two if it read two
    # steps' results in one pass: a loaded machine), not after 4 tokens
    assert status == 200 and sum(sizes) == 17 and sizes[0] < 4, sizes
    assert all(n >= 4 for n in sizes[1:-1]) and len(sizes) <= 1 + 16 // 4 + 1, sizes
    assert [t for e in chunks for t in e["choices"][0]["token_ids"]] == whole["token_ids"]
    assert "".join(e["choices"][0]["text"] for e in chunks) == whole["text"]


# -- disconnects and overload --------------------------------------------------------------------


@pytest.mark.timeout(90)
def test_client_disconnect_mid_stream_aborts_and_frees_kv():
    """Three streams of 450 tokens whose clients leave after 3 chunks, and a non-streamed one
    whose client leaves: each request is aborted and every group's KV usage returns to 0.

    None may finish first, on any machine: die 0 is stopped (the lockstep pod steps no more)
    except while the next stream gets its 3 chunks, so the streams advance by those few steps
    (and the test's reaction to the third chunk), far from 450."""
    server = ServerProc("--model", "small", *HELD)
    die0 = _pid(server, "die", 0)
    try:
        socks = []
        with stopped(die0):
            for i in range(3):
                s = socket.create_connection((server.host, server.port), timeout=10)
                body = json.dumps({"model": "xpod-small", "prompt": f"leave {i}",
                                   "max_tokens": 450, "stream": True,
                                   "ignore_eos": True}).encode()  # fmt: skip
                head = (b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type:"
                        b" application/json\r\nContent-Length: %d\r\n\r\n" % len(body))  # fmt: skip
                s.sendall(head + body)
                got = b""
                os.kill(die0, signal.SIGCONT)
                try:
                    while got.count(b"data: ") < 3:
                        got += s.recv(65536)
                finally:
                    os.kill(die0, signal.SIGSTOP)
                socks.append(s)
            kv = "xpod_kv_cache_usage_perc"
            wait_for(lambda: sum(metric(server.metrics(), kv, group=g) for g in (0, 1)),
                     what="KV in use while 3 requests run")  # fmt: skip
            # and one non-streamed request (aiohttp cancels its handler when the client leaves)
            s = socket.create_connection((server.host, server.port), timeout=10)
            body = json.dumps({"model": "xpod-small", "prompt": "wait", "max_tokens": 400,
                               "ignore_eos": True}).encode()  # fmt: skip
            head = (b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type:"
                    b" application/json\r\nContent-Length: %d\r\n\r\n" % len(body))  # fmt: skip
            s.sendall(head + body)
            socks.append(s)
            wait_for(lambda: metric(server.metrics(), "xpod_num_requests_inflight_http") >= 4,
                     what="the non-streamed request to start")  # fmt: skip
            for s in socks:
                s.close()
            # every client gone is seen (and its request aborted) with the pod still held
            wait_for(lambda: sum(metric(server.metrics(), "xpod_request_success_total",
                                        group=g, finished_reason="abort")
                                 for g in (0, 1)) == 4, what="4 aborts")  # fmt: skip
        m = settle(server)  # running, waiting, KV usage 0 on every group
        aborts = sum(metric(m, "xpod_request_success_total", group=g, finished_reason="abort")
                     for g in (0, 1))  # fmt: skip
        assert aborts == 4
        done = sum(metric(m, "xpod_request_success_total", group=g, finished_reason=r)
                   for g in (0, 1) for r in ("stop", "length"))  # fmt: skip
        assert done == 0
    finally:
        server.stop()


@pytest.mark.timeout(120)
def test_overload_gets_503_with_retry_after_then_recovers(server):
    """2 groups x (4 running + 4 held by the master) + 4 in the shell's queue = 20 admitted;
    more at once get 503, and the server serves again when the load is gone."""

    async def run():
        async with aiohttp.ClientSession() as http:

            async def one(i):
                body = {"model": MODEL, "prompt": f"load {i}", "max_tokens": 30,
                        "ignore_eos": True}  # fmt: skip
                async with http.post(server.url + "/v1/completions", json=body) as r:
                    data = await r.json()
                    return r.status, r.headers.get("Retry-After"), data

            return await asyncio.gather(*[one(i) for i in range(40)])

    res = asyncio.run(run())
    codes = [s for s, _, _ in res]
    assert set(codes) == {200, 503}, codes
    assert codes.count(200) >= 20, codes
    for status, retry, data in res:
        if status == 503:
            assert retry and data["error"]["code"] == "overloaded", (retry, data)
        else:
            assert data["usage"]["completion_tokens"] == 30
    settle(server)
    m = server.metrics()
    assert metric(m, "xpod_http_requests_rejected_total", reason="overload") >= codes.count(503)
    status, _, data = server.post("/v1/completions", {"prompt": "after", "max_tokens": 3,
                                                      "ignore_eos": True})  # fmt: skip
    assert status == 200


# -- health and metrics --------------------------------------------------------------------------


@pytest.mark.timeout(60)
def test_metrics_have_every_family_by_group(server):
    server.post("/v1/completions", {"prompt": "metric", "max_tokens": 4, "stream": True})
    m = server.metrics()
    names = {k[0] for k in m}
    for n in ("xpod_num_requests_running", "xpod_num_requests_waiting", "xpod_kv_cache_usage_perc",
              "xpod_kv_blocks_free", "xpod_kv_blocks_cached", "xpod_prefix_cache_queries_total",
              "xpod_prefix_cache_hits_total", "xpod_num_preemptions_total",
              "xpod_request_success_total", "xpod_prompt_tokens_total",
              "xpod_generation_tokens_total", "xpod_time_to_first_token_seconds_bucket",
              "xpod_inter_token_latency_seconds_bucket", "xpod_e2e_request_latency_seconds_bucket",
              "xpod_request_queue_time_seconds_bucket", "xpod_step_seconds_bucket",
              "xpod_dummy_steps_total", "xpod_scheduling_bubble_seconds_total",
              "xpod_moe_wait_share", "xpod_attention_imbalance_bucket",
              "xpod_process_cpu_seconds_total"):  # fmt: skip
        assert n in names, n
    assert metric(m, "xpod_kv_blocks_total", group=0) > 0
    assert 0 < metric(m, "xpod_moe_wait_share") < 1
    roles = {dict(k[1]).get("role") for k in m if k[0] == "xpod_process_pid"}
    assert roles == {"shell", "master", "die"}
    # ?name[]= restricts the exposition to those samples (a cheap scrape)
    _, _, data = server.request("GET", "/metrics?name[]=xpod_kv_cache_usage_perc")
    fams = list(text_string_to_metric_families(data.decode()))
    assert [f.name for f in fams] == ["xpod_kv_cache_usage_perc"]
    assert sorted(s.labels["group"] for s in fams[0].samples) == ["0", "1"]


def _pid(server: ServerProc, role: str, group: int) -> int:
    return int(metric(server.metrics(), "xpod_process_pid", role=role, group=group))


def _wait_health(server: ServerProc, want: int, within_s: float = 30.0) -> float:
    t0 = time.monotonic()
    while True:
        status, _, data = server.request("GET", "/health")
        if status == want:
            return time.monotonic() - t0
        if time.monotonic() - t0 > within_s:
            raise AssertionError(f"/health is {status}, not {want}, after {within_s} s: {data}")
        time.sleep(0.05)


@pytest.mark.timeout(90)
@pytest.mark.parametrize("role", ["die", "master"])
def test_health_sees_a_hung_die_or_master(interval_server, role):
    s = interval_server
    _wait_health(s, 200)
    pid = _pid(s, role, 1)
    os.kill(pid, signal.SIGSTOP)
    try:
        # unhealthy while it is stopped (how soon after the 1 s timeout is a benchmark's
        # figure, not a test's: the bar is the timeout + a heartbeat period)
        _wait_health(s, 503)
        _, _, data = s.request("GET", "/health")
        body = json.loads(data)
        assert body["status"] == "unhealthy" and not body["groups"]["1"]["ok"], body
    finally:
        os.kill(pid, signal.SIGCONT)
    _wait_health(s, 200)
    status, _, _ = s.post("/v1/completions", {"prompt": "alive", "max_tokens": 3})
    assert status == 200


# -- shutdown ---------------------------------------------------------------------------------


async def _streams(url: str, n: int, max_tokens: int, model: str = MODEL) -> list:
    """n concurrent streams: [(finish_reason, chunks, usage)] or ("http", status, body)."""
    async with aiohttp.ClientSession() as http:

        async def one(i):
            body = {"model": model, "prompt": f"drain {i}", "max_tokens": max_tokens,
                    "stream": True, "ignore_eos": True,
                    "stream_options": {"include_usage": True}}  # fmt: skip
            async with http.post(url + "/v1/completions", json=body) as r:
                data = await r.read()
            if r.status != 200:
                return ("http", r.status, data)
            ev = sse_events(data)
            if "error" in ev[-1]:  # the engine failed mid-stream: an error event, [DONE]
                return ("error", len(ev) - 1, ev[-1]["error"])
            return (ev[-2]["choices"][0]["finish_reason"], len(ev) - 1, ev[-1]["usage"])

        return await asyncio.gather(*[one(i) for i in range(n)])


def _run_streams(url: str, n: int, max_tokens: int, model: str = MODEL):
    out: list = []
    t = threading.Thread(
        target=lambda: out.extend(asyncio.run(_streams(url, n, max_tokens, model)))
    )
    t.start()
    return t, out


def _wait_running(s: ServerProc, n: int, timeout_s: float = 30) -> None:
    deadline = time.monotonic() + timeout_s
    while metric(s.metrics(), "xpod_num_requests_inflight_http") < n:
        assert time.monotonic() < deadline, "the requests did not start"
        time.sleep(0.05)


@pytest.mark.timeout(120)
def test_sigterm_under_load_drains_and_exits_0():
    s = ServerProc("--drain-timeout", "60", "--model", "small", *HELD)
    die0 = _pid(s, "die", 0)
    try:
        # die 0 stopped (the lockstep pod steps no more): the six cannot finish before the
        # drain has been seen, however fast the machine
        with stopped(die0):
            t, out = _run_streams(s.url, 6, 150, "xpod-small")
            _wait_running(s, 6)
            s.send(signal.SIGTERM)
            _wait_health(s, 503)
            status, headers, data = s.post("/v1/completions", {"prompt": "late",
                                                               "max_tokens": 2})  # fmt: skip
            assert status == 503 and json.loads(data)["error"]["code"] == "shutting_down"
            assert headers.get("Retry-After")
    finally:
        err = s.stop(sig=None if s.proc.poll() is None else signal.SIGTERM, timeout_s=60)
        t.join(30)
    assert len(out) == 6
    for reason, _, usage in out:
        assert reason == "length" and usage["completion_tokens"] == 150, out
    assert "drained 6 of 6" in err, err


@pytest.mark.timeout(120)
def test_ctrl_c_past_the_drain_timeout_aborts_and_exits_0():
    # one request at a time, die 0 stopped (the pod steps no more) until the 0.1 s drain has
    # ended: the first is still running then, the rest queued, however fast the machine
    s = ServerProc("--drain-timeout", "0.1", "--max-num-seqs", "1", "--model", "small", *HELD)
    die0 = _pid(s, "die", 0)
    try:
        with stopped(die0):
            t, out = _run_streams(s.url, 4, 480, "xpod-small")
            _wait_running(s, 4)
            s.send(signal.SIGINT)
            wait_for(lambda: any("aborted" in line for line in s.err), what="the drain's end")
    finally:
        err = s.stop(sig=None, timeout_s=60)
        t.join(30)
    assert len(out) == 4
    for reason, _, usage in out:
        assert reason == "abort" and usage["completion_tokens"] < 480, out
    assert "aborted 4" in err, err


@pytest.mark.timeout(120)
def test_a_killed_die_ends_requests_with_an_error_and_exit_1():
    s = ServerProc("--model", "small", "--no-recover", *HELD)  # the control of recovery
    die0, die1 = _pid(s, "die", 0), _pid(s, "die", 1)
    try:
        with stopped(die0):  # the two cannot finish before the kill, however fast the machine
            t, out = _run_streams(s.url, 2, 400, "xpod-small")
            _wait_running(s, 2)
            os.kill(die1, signal.SIGKILL)
            wait_for(lambda: s.proc.poll() is not None or "die 1" in "".join(s.err),
                     what="the engine to see die 1's exit")  # fmt: skip
    finally:
        err = s.stop(sig=None, expect=1, timeout_s=60)
        t.join(30)
    assert len(out) == 2, out
    for reason, _, error in out:
        assert reason == "error" and error["type"] == "server_error", out
        assert "die 1" in error["message"], error
    assert "error" in err.lower()


@pytest.mark.timeout(60)
def test_a_busy_port_or_a_bad_flag_fails_before_launch():
    """Exit status 2 and one line naming the flag; nothing launched, nothing left."""
    busy = socket.socket()
    busy.bind(("127.0.0.1", 0))
    busy.listen(1)
    port = busy.getsockname()[1]
    segs = _our_segments()
    try:
        cases = [("--port", str(port)), ("--port", "70000"), ("--dies", "0"),
                 ("--drain-timeout", "-1"), ("--max-body", "0"), ("--queue-ahead", "-2"),
                 ("--stream-interval", "0")]  # fmt: skip
        # all at once (each is its own interpreter, refused before any pod: nothing shared)
        procs = []
        for flag, value in cases:
            cmd = [sys.executable, "-m", "runtime.cli", "serve", "--model", "tiny", flag, value]
            procs.append(subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE,
                                          stderr=subprocess.PIPE, text=True))  # fmt: skip
        try:
            for (flag, value), proc in zip(cases, procs, strict=True):
                _, stderr = proc.communicate(timeout=30)
                assert proc.returncode == 2, ([flag, value], stderr)
                lines = stderr.strip().splitlines()
                assert len(lines) == 1 and flag in lines[0], ([flag, value], stderr)
        finally:
            for proc in procs:
                if proc.poll() is None:
                    proc.kill()
                    proc.communicate()
    finally:
        busy.close()
    assert _our_segments() == segs


# -- correctness: concurrent streams against the schedule replay -------------------------------


class InProcessServer:
    """A Server over an engine of this process (so its step log can be replayed), served on a
    thread's event loop."""

    def __init__(self, **engine_options):
        from runtime.api.options import ServerOptions
        from runtime.api.server import Server, bind
        from runtime.engine import Engine, EngineConfig

        self.engine = Engine.launch(EngineConfig(**engine_options))
        self.server = Server(self.engine, ServerOptions(self.engine.config, port=0))
        sock = bind("127.0.0.1", 0)
        self.url = f"http://127.0.0.1:{sock.getsockname()[1]}"
        self.status: list[int] = []
        self.thread = threading.Thread(
            target=lambda: self.status.append(asyncio.run(self.server.serve(sock, signals=False))),
            daemon=True,
        )
        self.thread.start()
        wait_for(lambda: self.server.loop is not None and self.server.url, what="the server")

    def close(self) -> None:
        self.server.stop()
        self.thread.join(30)
        self.engine.close()


@pytest.mark.timeout(240)
@pytest.mark.parametrize("output_procs", [False, True])
def test_concurrent_streams_equal_the_schedule_replay(output_procs):
    """24 concurrent requests (streamed and not, greedy and seeded, chunked prefill, shared
    prefixes, a small KV pool that forces preemption: four requests of a group need 5 shared
    and 4 x 5 own blocks of 16 at their end, of 16): each response's token ids equal the
    tokens its request sampled in the logged steps, and the replay of those steps through the
    single-process reference is bit-equal."""
    from runtime.engine.replay import replay

    srv = InProcessServer(dies=2, model="tiny", max_num_seqs=4, max_num_batched_tokens=32,
                          num_blocks=16, log_steps=True, keep_logits=True,
                          output_procs=output_procs)  # fmt: skip
    base = "the quick brown fox jumps over the lazy dog, " * 2
    try:

        async def run():
            async with aiohttp.ClientSession() as http:

                async def one(i):
                    body = {"model": MODEL, "prompt": base + "x" * (i % 7) if i % 3 else f"p{i}",
                            "max_tokens": 60 + 5 * (i % 4), "temperature": 0.8 * (i % 2),
                            "seed": i, "stream": i % 2 == 0, "return_token_ids": True}  # fmt: skip
                    async with http.post(srv.url + "/v1/completions", json=body) as r:
                        rid = int(r.headers["X-Xpod-Request"])
                        data = await r.read()
                        assert r.status == 200, data
                    if body["stream"]:
                        ev = sse_events(data)
                        toks = [t for e in ev for t in e["choices"][0]["token_ids"]]
                        reason = ev[-1]["choices"][0]["finish_reason"]
                    else:
                        ch = json.loads(data)["choices"][0]
                        toks, reason = ch["token_ids"], ch["finish_reason"]
                    return rid, toks, reason, body["max_tokens"]

                return await asyncio.gather(*[one(i) for i in range(24)])

        res = asyncio.run(run())
    finally:
        srv.close()
    eng = srv.engine
    logs = eng.step_log
    m, c = eng.model, eng.config
    assert sum(s["num_preemptions"] for s in eng.stats.values()) > 0, "the pool must preempt"
    sampled: dict[int, list] = {}
    for g in sorted(logs):
        for step in logs[g]:
            for rid, tok in step["sampled"]:
                sampled.setdefault(rid, []).append((step["step"], tok))
    preempted = sum(s["num_preemptions"] for s in eng.stats.values())
    for rid, toks, reason, max_tokens in res:
        assert reason in ("stop", "length"), (rid, reason)
        assert len(toks) == max_tokens or toks[-1] == EOS
        # every served token was sampled for this request, in order; the others were dropped
        # (sampled after the finish, or in flight when the request was preempted)
        seq = [t for _, t in sorted(sampled[rid])]
        assert _subsequence(toks, seq) and len(seq) - len(toks) <= 2 + 2 * preempted, (toks, seq)
    rep = replay(m, c.dies, c.quant, c.blocks, c.block_size, logs, c.combine_dtype)
    assert rep.token_mismatches == [] and rep.logit_mismatches == [], rep
    assert rep.bit_equal and rep.logits_compared == rep.sampled


def _subsequence(short: list[int], long: list[int]) -> bool:
    it = iter(long)
    return all(any(x == y for y in it) for x in short)


@pytest.mark.timeout(90)
def test_sigterm_stops_a_server_whose_terminal_is_gone():
    """The server's stdout and stderr lose their reader (a closed terminal, a pipe whose reader
    exited): SIGTERM still drains and stops it, exit status 0, no process or segment left."""
    cmd = [sys.executable, "-m", "runtime.cli", "serve", "--port", "0", "--model", "tiny",
           "--dies", "2"]  # fmt: skip
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        deadline, line = time.monotonic() + START_S, b""
        while b" on http://" not in line:
            assert proc.poll() is None and time.monotonic() < deadline, "xpod serve did not start"
            if select.select([proc.stdout], [], [], 0.5)[0]:
                line = proc.stdout.readline()
        pids = [c.pid for c in psutil.Process(proc.pid).children(recursive=True)]
        pods = {n.split(".")[1] for n in _segments() if n.endswith(".ctl")
                and _launcher(n) == proc.pid}  # fmt: skip
        assert pods and pids
        proc.stdout.close()  # nobody reads the server's output any more
        proc.stderr.close()
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(40) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)
    assert not _alive(pids)
    assert not {n for n in _segments() if n.split(".")[1] in pods}
