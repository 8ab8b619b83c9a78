"""Output handling: a request's tokens -> the bytes its HTTP client reads (001 4.1).

`OutputHandler` keeps a `Renderer` (`runtime.engine.render`) per rendered request and turns a
master's `out` message (token deltas `[id, start, tokens]`, `start` the output index of the
first, and finishes) into the shell's: `data` entries `[id, tokens counted, bytes, final,
status, start, token ids]` for rendered requests (the ids keep the shell's ledger: what each
client has), token deltas for the others, the finishes unchanged (a stop string's finish says
"stop"). A stop string found in the tokens ends the request at once for the client (`final`
data) and is returned so that the caller aborts it in its master (abort-as-stop).

Where it runs (`EngineConfig.output_procs`):
- off: in the shell, on the engine's receiver thread;
- on (output shortcutting): in one output process per DP group (`output_main`). The master
  sends it `open` {id, n_prompt, render} when a request arrives and every `out` message, it
  sends the rendered `out` to the shell and stop-string aborts to the master, and ends at the
  master's `eof` (or the shell's `shutdown`).

```
 master g --(open, out, eof)--> output g --(out with data)--> shell
     ^------------(abort: stop string)-----'
```
"""

from __future__ import annotations

import logging
import os
import traceback
from dataclasses import dataclass

import zmq

from runtime.engine import wire
from runtime.engine.render import Renderer
from runtime.engine.wire import engine_socket, master_socket, output_socket
from runtime.pod.proc import batch_scheduling, default_sigterm, follow_parent

log = logging.getLogger(__name__)
EARLY_MAX = 4096  # cached counts kept for requests not opened yet


class OutputHandler:
    """Renderers of the rendered requests of one group (or of all, in the shell)."""

    def __init__(self) -> None:
        self.renderers: dict[int, Renderer] = {}
        self.fed: dict[int, int] = {}  # rendered request -> tokens fed (output index of the next)
        self.replayed = 0  # tokens dropped because a renderer had them already
        self.early: dict[int, int] = {}  # a PD request's cached tokens come before its open

    def cached_of(self, rid: object, n: object) -> None:
        """A PD prefill master's count of request rid's prompt tokens not computed."""
        if not isinstance(rid, int) or not isinstance(n, int):
            return
        r = self.renderers.get(rid)
        if r is not None:
            r.cached = max(r.cached, n)
            return
        self.early[rid] = max(self.early.get(rid, 0), n)
        while len(self.early) > EARLY_MAX:  # a request never opened here (refused, aborted)
            self.early.pop(next(iter(self.early)))

    def open(self, rid: int, spec: dict | None, n_prompt: int, replay: list[int] = ()) -> None:
        """Render request `rid`; `replay`: the tokens its client already has (a request resumed
        after a restart): fed to the new renderer with its bytes dropped, so that it goes on in
        the state the lost one was in (rendering is a function of the tokens)."""
        early = self.early.pop(rid, 0)
        if spec:
            r = self.renderers[rid] = Renderer(spec, n_prompt)
            r.cached = early
            if replay:
                r.feed(list(replay), last=False)
                r.take_count()
                self.fed[rid] = len(replay)

    def process(self, body: dict) -> tuple[dict, list[int]]:
        """A master's `out` body -> (the shell's `out` body, ids a stop string ended)."""
        raw, data, stops = [], [], []
        done = body.get("done", [])
        ending = {rec[0] for rec in done if not rec[4]}  # their last chunk carries the text
        for rid, n in body.get("cached") or ():  # admitted: prompt tokens not computed
            if rid in self.renderers:
                self.renderers[rid].cached = max(self.renderers[rid].cached, int(n))
        for rid, start, toks in body.get("deltas", ()):
            r = self.renderers.get(rid)
            if r is None:
                raw.append([rid, start, toks])
                continue
            fed = self.fed.get(rid, 0)
            if start < fed:  # a token the renderer has had (never twice to a client)
                self.replayed += min(len(toks), fed - start)
                toks, start = toks[fed - start :], fed
            self.fed[rid] = start + len(toks)
            if r.finished:
                continue  # tokens planned before the stop's abort landed: dropped
            chunk, stopped = r.feed(toks, last=rid in ending)
            if stopped:
                stops.append(rid)
                data.append([rid, r.take_count(), chunk + r.finish("stop"), True, 200, start, toks])
            elif chunk or (r.stream and rid not in ending):
                data.append([rid, r.take_count(), chunk, False, 200, start, toks])
            elif toks:  # no bytes yet: the ids alone, for the shell's ledger
                data.append([rid, 0, b"", False, 200, start, toks])
        for rec in done:
            r = self.renderers.pop(rec[0], None)
            start = self.fed.pop(rec[0], 0)
            if r is None:
                continue
            if r.stopped:
                rec[1] = "stop"
                rec[4] = ""
                continue
            r.cached = max(r.cached, int(rec[3] or 0))
            fin = r.finish(rec[1], rec[4])
            data.append([rec[0], r.take_count(), fin, True, 500 if rec[4] else 200, start, []])
        out = {"group": body.get("group", -1), "gen": body.get("gen", 0), "deltas": raw,
               "done": done, "data": data, "pd": body.get("pd", []),
               "pool": body.get("pool", []), "cached": body.get("cached", [])}  # fmt: skip
        return out, stops


@dataclass(frozen=True)
class OutputSpec:
    group: int
    run_dir: str


def output_main(spec: OutputSpec, engine_pid: int) -> None:
    """Entry of an output process (see the module docstring)."""
    default_sigterm()  # not the handler of the shell it was forked from
    if not follow_parent(engine_pid):  # the engine is already gone
        os._exit(3)
    batch_scheduling()  # woken per token batch, it must not preempt a die mid-step
    logging.basicConfig(format=f"output {spec.group} %(levelname)s %(name)s: %(message)s")
    ctx = zmq.Context()
    inbox = ctx.socket(zmq.PULL)
    inbox.bind(output_socket(spec.run_dir, spec.group))
    shell = ctx.socket(zmq.PUSH)
    shell.setsockopt(zmq.LINGER, 1000)
    shell.connect(engine_socket(spec.run_dir))
    master = ctx.socket(zmq.PUSH)
    master.setsockopt(zmq.LINGER, 0)
    master.connect(master_socket(spec.run_dir, spec.group))
    handler = OutputHandler()
    try:
        while True:
            kind, body = wire.unpack(inbox.recv(), {"open", "cached", "out", "eof", "shutdown"})
            if kind == "cached":  # a PD request's prefill master: its prompt tokens not computed
                handler.cached_of(body.get("id"), body.get("n", 0))
            elif kind == "open":
                handler.open(body["id"], body.get("render"), body.get("n_prompt", 0),
                             body.get("replay") or [])  # fmt: skip
            elif kind == "out":
                out, stops = handler.process(body)
                for rid in stops:
                    master.send(wire.pack("abort", {"id": rid}))
                shell.send(wire.pack("out", out))
            else:
                break
    except Exception:  # noqa: BLE001 - logged with the group, then exit non-zero
        log.error("output %d failed:\n%s", spec.group, traceback.format_exc())
        raise SystemExit(1) from None
    finally:
        for s in (inbox, shell, master):
            s.close(linger=1000 if s is shell else 0)
        ctx.term()
