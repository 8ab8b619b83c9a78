"""`xpod serve`: an OpenAI-compatible HTTP server (the TE-shell of 001 4.1) in front of the
serving engine (`runtime.engine`).

```
xpod serve --dies 4 --model small --port 8000        # --port 0 picks a free port
curl -N localhost:8000/v1/completions -H 'content-type: application/json' \\
     -d '{"model":"xpod-small","prompt":"hello","max_tokens":32,"stream":true}'
```

Processes: this one (the shell: aiohttp on uvloop, the engine's DP load balancer and receiver
thread, the pod launcher), one master per DP group, one output process per group with
`--output-procs`, and the dies. Routes:

| route | what |
| --- | --- |
| `GET /v1/models`, `/v1/models/{id}` | the served model (`xpod-<preset>`) |
| `POST /v1/completions`, `/v1/chat/completions` | `runtime.api.protocol` (fields, chat template) |
| `GET /health` | 200 while every group answers heartbeats; else 503 (see below) |
| `GET /metrics` | Prometheus text (`runtime.api.metrics`); `?name[]=...` picks samples |

Admission: a request goes to the engine, whose balancer sends it to a group or holds it while
every group is at its limit; past `--max-queue` held requests the answer is 503 with
`Retry-After`. A client that disconnects aborts its request (aiohttp cancels the handler).

Health: 503 once a group misses its heartbeat for `--health-timeout`, when the engine failed,
and while draining. Heartbeat: every `--health-timeout / 4` (at most 1 s) the shell pings
every master; the master writes the ping into its die's serving words and rings it; the die
echoes it from its step loop (or its park loop); the master answers once it sees the echo. A
hung die or master stops answering, and `/health` turns 503 within `--health-timeout`.

Recovery (on by default, `--no-recover` for the old behaviour): a die, master or output
process that dies or hangs is restarted by the engine's supervisor with every accepted request
kept; `/health` answers 503 `{"status": "recovering"}` meanwhile, new requests wait in the
shell (up to `--max-queue`), and every stream continues from the tokens its client has. A fault
the engine gives up on (too many restarts) ends the in-flight requests with an error and the
server exits 1, as before (`runtime.engine.supervisor`).

Shutdown (SIGTERM, SIGINT / Ctrl-C, SIGHUP): `/health` turns 503 and new requests get 503;
in-flight requests run to their end for up to `--drain-timeout` seconds, then the rest are
aborted (`finish_reason` "abort"); the listener closes, the engine stops every process and
removes every segment and socket; exit status 0. A second signal ends the drain at once. If the
engine fails (a die or master died), in-flight requests end with an error and the server exits
with status 1.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import json
import logging
import os
import signal
import socket
import sys
import time
from typing import TextIO

from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from memory.errors import ConfigError
from runtime.api.metrics import Metrics
from runtime.api.options import ServerOptions
from runtime.api.protocol import (
    APIError,
    ModelInfo,
    parse_chat,
    parse_completion,
    request_id,
)
from runtime.engine import Engine, EngineError
from runtime.engine.render import error_body
from runtime.pod.proc import batch_scheduling

PROG = "xpod serve"
log = logging.getLogger("xpod.serve")
SSE_HEADERS = {"Content-Type": "text/event-stream; charset=utf-8", "Cache-Control": "no-cache",
               "X-Accel-Buffering": "no"}  # fmt: skip
STATUS_CODES = {400: "bad_request", 404: "not_found", 405: "method_not_allowed",
                413: "request_too_large", 415: "unsupported_media_type"}  # fmt: skip


class Server:
    """The shell: routes, admission, heartbeats, drain. `serve()` runs it until stopped."""

    def __init__(self, engine: Engine, opts: ServerOptions):
        self.engine, self.opts = engine, opts
        m = engine.model
        self.model = ModelInfo(opts.served_name, m.max_seq_len, m.vocab_size, int(time.time()))
        self.inflight: set[int] = set()  # engine ids of requests whose handler runs
        self.draining = False
        self.stop_event: asyncio.Event | None = None
        self.signals = 0
        self.exit_status = 0
        self.served = 0
        self.aborted_at_drain = 0
        self.metrics = Metrics(engine, extra={
            "xpod_num_requests_pending": self._pending,
            "xpod_num_requests_inflight_http": self._inflight,
            "xpod_health_ok": self._healthy,
        })  # fmt: skip
        self.url = ""
        self.loop: asyncio.AbstractEventLoop | None = None

    def _pending(self) -> float:
        """Requests the shell holds because every group is at its limit."""
        return self.engine.num_waiting()

    def _inflight(self) -> float:
        """Generation requests whose HTTP handler is running."""
        return len(self.inflight)

    def _healthy(self) -> float:
        """1 if /health would answer 200."""
        return 1.0 if self.health()[0] == 200 else 0.0

    # -- the app --------------------------------------------------------------------------------

    def app(self) -> web.Application:
        app = web.Application(client_max_size=self.opts.max_body_bytes,
                              middlewares=[self._errors])  # fmt: skip
        app.router.add_get("/v1/models", self.models)
        app.router.add_get("/v1/models/{model}", self.model_card)
        app.router.add_post("/v1/completions", self.completions)
        app.router.add_post("/v1/chat/completions", self.chat)
        app.router.add_get("/health", self.health_route)
        app.router.add_get("/metrics", self.metrics_route)
        return app

    @web.middleware
    async def _errors(self, request: web.Request, handler) -> web.StreamResponse:
        """Every error as OpenAI's error body, with its status; the server goes on."""
        try:
            return await handler(request)
        except APIError as e:
            return self._error(e.status, e.body(), e)
        except web.HTTPException as e:
            if e.status < 400:
                raise
            code = STATUS_CODES.get(e.status, "http_error")
            msg = e.reason
            if e.status == 413:
                msg = f"request body too large: the limit is {self.opts.max_body_bytes} bytes"
            if e.status == 405:
                msg = f"method {request.method} is not allowed on {request.path}"
            elif e.status == 404:
                msg = f"no route {request.method} {request.path}"
            resp = self._error(e.status, error_body(e.status, msg, code), e)
            if "Allow" in e.headers:
                resp.headers["Allow"] = e.headers["Allow"]
            return resp
        except EngineError as e:
            return self._error(503, error_body(503, f"the engine is down: {e}", "engine_down"), e)
        except (asyncio.CancelledError, ConnectionResetError):
            raise
        except Exception as e:  # noqa: BLE001 - a bug must not stop the server: 500, logged
            log.exception("%s %s failed", request.method, request.path)
            return self._error(500, error_body(500, f"internal error: {type(e).__name__}: {e}",
                                               "internal_error"), e)  # fmt: skip

    @staticmethod
    def _error(status: int, body: dict, exc: BaseException) -> web.Response:
        headers = {"Retry-After": "1"} if status == 503 else None
        return web.json_response(body, status=status, headers=headers)

    async def models(self, request: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [self.model.card()]})

    async def model_card(self, request: web.Request) -> web.Response:
        name = request.match_info["model"]
        if name != self.model.name:
            raise APIError(404, f"The model `{name}` does not exist.", "model", "model_not_found")
        return web.json_response(self.model.card())

    def health(self) -> tuple[int, dict]:
        h = self.engine.health(self.opts.health_timeout_s)
        status = "ok" if h["ok"] else ("down" if not h["up"] else "unhealthy")
        if h["up"] and getattr(self.engine, "recovering", False):
            status = "recovering"  # a restart: requests are held, then resumed
        if self.draining:
            status = "draining"
        body = {"status": status, "groups": {str(g): v for g, v in h["groups"].items()}}
        if h["error"]:
            body["error"] = h["error"]
        return (200 if status == "ok" else 503), body

    async def health_route(self, request: web.Request) -> web.Response:
        status, body = self.health()
        return web.json_response(body, status=status)

    async def metrics_route(self, request: web.Request) -> web.Response:
        """Prometheus text; `?name[]=a&name[]=b` restricts it to those samples (as
        prometheus-client's own handler does): a cheap scrape of a few gauges."""
        names = request.query.getall("name[]", [])
        reg = self.metrics.registry
        data = generate_latest(reg.restricted_registry(names) if names else reg)
        return web.Response(body=data, headers={"Content-Type": CONTENT_TYPE_LATEST})

    async def completions(self, request: web.Request) -> web.StreamResponse:
        return await self._generate(request, parse_completion, "completion")

    async def chat(self, request: web.Request) -> web.StreamResponse:
        return await self._generate(request, parse_chat, "chat")

    # -- generation -----------------------------------------------------------------------------

    async def _generate(self, request: web.Request, parse, kind: str) -> web.StreamResponse:
        if self.draining:
            self.metrics.rejected.labels("draining").inc()
            raise APIError(503, "the server is shutting down", None, "shutting_down")
        body = await self._json(request)
        req = parse(body, self.model)
        if self.engine.num_waiting() >= self.opts.max_queue:
            self.metrics.rejected.labels("overload").inc()
            raise APIError(503, f"the server is overloaded ({self.engine.num_waiting()} requests"
                           " waiting for a DP group): retry later", None, "overloaded")  # fmt: skip
        req.render["id"] = request_id(kind)
        rid, deltas = self.engine.open_stream(req.tokens, req.params, render=req.render,
                                              cache_salt=req.cache_salt)  # fmt: skip
        self.inflight.add(rid)
        headers = {"X-Request-Id": req.render["id"], "X-Xpod-Request": str(rid)}
        try:
            async with contextlib.aclosing(deltas):
                if req.render["stream"]:
                    return await self._stream(request, deltas, headers)
                data, status = b"", 200
                async for d in deltas:
                    data += d.data
                    status = d.status if d.final else status
                if status == 503:
                    headers["Retry-After"] = "1"
                return web.Response(body=data, status=status, headers=headers,
                                    content_type="application/json")  # fmt: skip
        finally:
            self.inflight.discard(rid)
            self.served += 1

    async def _stream(self, request: web.Request, deltas, headers: dict) -> web.StreamResponse:
        resp = web.StreamResponse(headers={**SSE_HEADERS, **headers})
        await resp.prepare(request)
        try:
            async for d in deltas:
                if d.data:
                    await resp.write(d.data)
            await resp.write_eof()
        except (ConnectionResetError, ConnectionError):
            pass  # the client left: closing `deltas` aborts the request
        return resp

    @staticmethod
    async def _json(request: web.Request) -> dict:
        raw = await request.read()  # 413 past client_max_size
        if not raw.strip():
            raise APIError(400, "the request body is empty (send a JSON object)", None,
                           "invalid_json")  # fmt: skip
        try:
            body = json.loads(raw)
        except (ValueError, UnicodeDecodeError) as e:
            raise APIError(400, f"the request body is not valid JSON: {e}", None,
                           "invalid_json") from None  # fmt: skip
        if not isinstance(body, dict):
            raise APIError(400, "the request body must be a JSON object", None, "invalid_json")
        return body

    # -- lifecycle ------------------------------------------------------------------------------

    def on_signal(self, name: str) -> None:
        self.signals += 1
        self.draining = True
        if self.stop_event is not None:
            self.stop_event.set()
        if self.signals == 1:
            say(
                f"{name}: draining {len(self.inflight)} request(s) (up to"
                f" {self.opts.drain_timeout_s:g} s; again to stop now)"
            )

    def stop(self) -> None:
        """Drain and stop, as a signal does (from any thread)."""
        if self.loop is not None:
            self.loop.call_soon_threadsafe(self.on_signal, "stop")

    async def _heartbeat(self) -> None:
        while True:
            if getattr(self.engine, "supervisor", None) is None:  # else it pings already
                with contextlib.suppress(EngineError):
                    self.engine.ping()
            if self.engine.failure is not None:
                say(f"error: {self.engine.failure}")
                self.exit_status = 1
                self.draining = True
                self.stop_event.set()
                return
            await asyncio.sleep(self.opts.heartbeat_s)

    async def serve(self, sock: socket.socket, signals: bool = True) -> int:
        """Serve on `sock` until a signal (`signals`: SIGTERM, SIGINT, SIGHUP drain it; the
        caller must be the main thread), `stop()`, or an engine failure; returns the exit
        status (0, or 1 after an engine failure)."""
        self.loop = loop = asyncio.get_running_loop()
        self.stop_event = asyncio.Event()
        if signals:
            for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
                loop.add_signal_handler(sig, self.on_signal, signal.Signals(sig).name)
        runner = web.AppRunner(self.app(), handler_cancellation=True, shutdown_timeout=1.0,
                               access_log=log if self.opts.access_log else None)  # fmt: skip
        await runner.setup()
        site = web.SockSite(runner, sock)
        await site.start()
        host, port = sock.getsockname()[:2]
        self.url = f"http://{host}:{port}"
        e = self.opts.engine
        dies = (
            f"{e.dies} attention + {e.expert_dies} expert dies, {e.domains} domain(s) x"
            f" {e.microbatches} micro-batch(es)"
            if e.expert_dies
            else f"{e.dies} dies"
        )
        say(f"serving {self.model.name} on {self.url}  ({dies}, max-num-seqs"
            f" {e.max_num_seqs}, lb {e.lb_policy}, output procs"
            f" {'on' if e.output_procs else 'off'})", sys.stdout)  # fmt: skip
        if self.opts.loop_receiver:
            self.engine.attach_loop(loop)
        beat = asyncio.create_task(self._heartbeat())
        try:
            await self.stop_event.wait()
            await self._drain()
            beat.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await beat
            await runner.cleanup()
        finally:
            self.engine.detach_loop()
        return self.exit_status

    async def _drain(self) -> None:
        t0 = time.monotonic()
        deadline = t0 + (self.opts.drain_timeout_s if self.exit_status == 0 else 0.5)
        n = len(self.inflight)
        while self.inflight and time.monotonic() < deadline and self.signals < 2:
            await asyncio.sleep(0.02)
        left = list(self.inflight)
        for rid in left:
            self.engine.abort(rid)
        self.aborted_at_drain = len(left)
        end = time.monotonic() + 5.0
        while self.inflight and time.monotonic() < end:  # the aborts' last chunks go out
            await asyncio.sleep(0.02)
        say(
            f"drained {n - len(left)} of {n} in-flight request(s) in"
            f" {time.monotonic() - t0:.2f} s, aborted {len(left)}; {self.served} served in all"
        )


def say(text: str, stream: TextIO | None = None) -> None:
    """A status line (stderr by default). A stream whose reader is gone (a closed terminal, a
    pipe whose reader exited) must not keep the server from draining and stopping: from then on
    it writes to /dev/null (what Python's docs advise for a broken pipe)."""
    stream = stream or sys.stderr
    try:
        print(f"{PROG}: {text}", file=stream, flush=True)
    except (OSError, ValueError):
        with contextlib.suppress(OSError, ValueError):
            devnull = os.open(os.devnull, os.O_WRONLY)
            os.dup2(devnull, stream.fileno())
            os.close(devnull)


def bind(host: str, port: int) -> socket.socket:
    """A listening TCP socket; ConfigError naming --host / --port if it cannot be had."""
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except socket.gaierror as e:
        raise ConfigError(f"argument --host: cannot resolve {host!r}: {e.strerror}") from None
    family, _, _, _, addr = infos[0]
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(addr)
        sock.listen(1024)
    except OSError as e:
        sock.close()
        if e.errno == errno.EADDRINUSE:
            raise ConfigError(f"argument --port: {host}:{port} is in use") from None
        raise ConfigError(f"argument --host/--port: cannot listen on {host}:{port}:"
                          f" {e.strerror or e}") from None  # fmt: skip
    sock.setblocking(False)
    return sock


def run(opts: ServerOptions) -> int:
    """Launch the engine, serve until a signal (or the engine fails), tear everything down."""
    import uvloop

    logging.basicConfig(format="%(asctime)s %(name)s %(levelname)s: %(message)s",
                        level=logging.INFO if opts.access_log else logging.WARNING)  # fmt: skip
    bind(opts.host, opts.port).close()  # a busy port fails before anything starts
    e = opts.engine
    what = (f"{e.dies} attention + {e.expert_dies} expert dies" if e.expert_dies
            else f"{e.prefill_dies} prefill + {e.decode_dies} decode dies" if e.pd
            else f"{e.dies} dies")  # fmt: skip
    say(f"launching {what}, model {e.model} ...")
    t0 = time.monotonic()
    engine = Engine.launch(e)
    if opts.shell_batch:  # the event loop, the engine's threads and zmq's I/O thread
        batch_scheduling(all_threads=True)
    try:
        say(f"engine ready in {time.monotonic() - t0:.1f} s")
        sock = bind(opts.host, opts.port if opts.port else 0)
        server = Server(engine, opts)
        status = uvloop.run(server.serve(sock))
    finally:
        old = [signal.signal(s, signal.SIG_IGN) for s in (signal.SIGINT, signal.SIGTERM)]
        try:
            engine.close()
        finally:
            for s, h in zip((signal.SIGINT, signal.SIGTERM), old, strict=True):
                signal.signal(s, h)
    if opts.replay_check:
        write_replay(engine, opts.replay_check)
    plan = engine.supervisor.fault_summary() if engine.supervisor is not None else {}
    if plan:  # each fault that did not fire was a warning of its own (with why)
        say(f"faults: planned {plan['planned']}, fired {plan['fired']} (verified"
            f" {plan['verified']}), detected {plan['detected']}, recovered {plan['recovered']},"
            f" not fired {len(plan.get('not_fired', []))}")  # fmt: skip
    say("stopped")
    return status


def write_replay(engine: Engine, path: str) -> None:
    """Replay what the engine served (its step log) and write the verdict as JSON."""
    from runtime.engine.replay import replay_engine

    say(f"replaying {sum(len(v) for v in engine.step_log.values())} logged steps ...")
    t0 = time.monotonic()
    rep = replay_engine(engine.config, engine.step_log, engine.tracker.prompts,
                        engine.tracker.namespaces)  # fmt: skip
    out = {"bit_equal": rep.bit_equal, "steps": rep.steps, "rows": rep.rows,
           "sampled": rep.sampled, "logits_compared": rep.logits_compared,
           "token_mismatches": rep.token_mismatches[:20],
           "logit_mismatches": rep.logit_mismatches[:20],
           "n_token_mismatches": len(rep.token_mismatches),
           "n_logit_mismatches": len(rep.logit_mismatches)}  # fmt: skip
    with open(path, "w", encoding="utf-8") as f:
        json.dump(out, f)
    say(f"replay: bit_equal {rep.bit_equal} over {rep.sampled} sampled tokens"
        f" ({time.monotonic() - t0:.1f} s) -> {path}")  # fmt: skip
