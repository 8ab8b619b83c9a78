"""The serving engine: a pod of dies running the executor loop, one master per DP group, and
the TE-shell role (DP load balancing, request bookkeeping) in the caller's process.

```python
from runtime.serve import Engine, SamplingParams
with Engine.launch(dies=4, model="small") as eng:
    for out in eng.generate(["hello", "the pod"], SamplingParams(max_tokens=32)):
        print(out.text, out.finish_reason)
    async for delta in eng.stream("a prompt", SamplingParams(max_tokens=64)):
        print(delta.text, end="")
```

Processes (all children of the caller; every one gone after `close`, Ctrl-C, SIGTERM or an
error): the dies of a `Pod` (one long `pod.run(serve_main)` on a thread of the caller), and one
master process per die (`runtime.master`). The caller's process keeps two threads: the pod run
and a receiver of the masters' messages. Requests go to masters as msgpack frames over zmq
`ipc://` sockets in the pod's owner-only run directory `/dev/shm/xpod.<pod>.run`; the per-step
hot path (master <-> die) is the shared-memory step ring (`runtime.stepring`).

Each request goes to one group, once, chosen by `sched.LoadBalancer` (001 §4.3: skip groups at
their batch limit, then the least KV usage counting the space reserved for every in-flight
request; `round_robin` for comparison). When every group is full the request waits here.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import math
import multiprocessing as mp
import os
import shutil
import threading
import time
from collections import deque
from dataclasses import dataclass, field

import zmq

from comm.quant import COMBINE_DTYPES
from memory import layout as L
from memory.errors import ConfigError, PodError
from runtime import wire
from runtime.executor import ServeSpec, serve_main
from runtime.master import MasterSpec, engine_socket, master_main, master_socket, output_socket
from runtime.model import EOS, EPLBConfig, ModelConfig, decode, encode, pod_config_for
from runtime.model.forward import prepared_for_fork
from runtime.openai_api import Renderer
from runtime.output import OutputHandler, OutputSpec, output_main
from runtime.pod import Pod
from runtime.pod.config import PodConfig
from runtime.stepring import Bell, bell_path
from sched import LoadBalancer, SamplingParams

log = logging.getLogger(__name__)
READY_TIMEOUT_S = 60.0
CLOSE_TIMEOUT_S = 10.0
WATCH_EVERY_S = 0.2  # how often the receiver thread checks that every master lives

__all__ = ["CompletionOutput", "Delta", "Engine", "EngineConfig", "EngineError", "SamplingParams"]


class EngineError(PodError):
    """The engine failed (a die or a master died, or it was closed); pending requests end with
    finish reason "error"."""


@dataclass(frozen=True)
class EngineConfig:
    """Every knob of an engine (validated at construction).

    Attributes:
        dies: DP groups = dies (TP = 1).
        model: preset name; model_overrides: ModelConfig fields to change.
        max_num_seqs: batch limit of a group (running + prefilling requests).
        queue_ahead: requests a group's master may hold waiting beyond its batch limit, so the
            next one is there the step a slot frees (-1: max_num_seqs; 0: the balancer holds
            every request a full group cannot run, as 001 §4.3 describes).
        max_num_batched_tokens: rows a die may run per step (the token budget, = the pod's
            a2a_max_batch: chunked prefill splits longer prompts).
        block_size, num_blocks: KV blocks per die (0: enough for max_num_seqs full contexts).
        async_depth: 2 = plan step n+1 while step n runs; 1 = synchronous.
        prefix_cache: reuse the KV of prompt prefixes (full blocks).
        lb_policy: "least_kv" or "round_robin".
        protocol, quant: the MoE all-to-all ("fused" | "pull", None | "int8").
        combine_dtype: combine rows in "bfloat16" (the paper's 16 bits) or "float32".
        gc_every: 0 = automatic GC; N = freeze after warm-up, collect every N steps (001 §4.4).
        pin: dies and masters pinned to cores: "auto" (when they fit), "on", "off".
        long_prefill_threshold: most tokens of one request per step (0 = the budget).
        log_steps: keep every step for the schedule replay (and logits: keep_logits).
        timeout_s: deadline of every wait in the pod.
        trace: a file name: record the dies' protocol, model and serving-loop steps and the
            masters' planning and result spans with their per-step counters, and write one
            Perfetto timeline there at `close` (master tracks above the dies); "" = no trace.
        warmup: run one token on every group before `launch` returns (the first step of a die
            pays for page faults and first-call costs: ~0.2 s on the small model).
        stream_interval: a streamed request's tokens go out every N tokens (its first one at
            once, the rest with its finish): vLLM's --stream-interval; fewer messages, chunks
            and client wake-ups per token (1: every step).
        output_procs: output shortcutting (001 4.1): one output process per group renders the
            tokens of rendered requests (`stream(render=...)`: the HTTP server's) and sends the
            bytes straight to the caller; off: the caller's receiver thread renders them.
        eplb: expert load balancing while serving (`runtime.model.EPLBConfig`), or None; a
            window is `every` busy steps of the pod (idle votes do not count).
    """

    dies: int = 4
    model: str = "small"
    model_overrides: dict = field(default_factory=dict)
    max_num_seqs: int = 8
    queue_ahead: int = -1
    max_num_batched_tokens: int = 64
    block_size: int = 16
    num_blocks: int = 0
    async_depth: int = 2
    prefix_cache: bool = True
    lb_policy: str = "least_kv"
    protocol: str = "fused"
    quant: str | None = None
    combine_dtype: str = "bfloat16"
    gc_every: int = 0
    pin: str = "auto"
    long_prefill_threshold: int = 0
    log_steps: bool = False
    keep_logits: bool = False
    timeout_s: float = 60.0
    trace: str = ""
    warmup: bool = True
    output_procs: bool = False
    stream_interval: int = 1
    eplb: EPLBConfig | None = None

    def __post_init__(self) -> None:
        m = self.model_config()
        m.validate(self.dies)
        if self.eplb is not None:
            if not isinstance(self.eplb, EPLBConfig):
                raise ConfigError(f"eplb: expected an EPLBConfig or None, got {self.eplb!r}")
            self.eplb.check(m, self.dies)
        if self.queue_ahead == -1:
            object.__setattr__(self, "queue_ahead", self.max_num_seqs)
        for name, lo in (
            ("queue_ahead", 0),
            ("max_num_seqs", 1),
            ("max_num_batched_tokens", 1),
            ("block_size", 1),
            ("num_blocks", 0),
            ("gc_every", 0),
            ("long_prefill_threshold", 0),
            ("stream_interval", 1),
        ):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < lo:
                raise ConfigError(f"{name}: {v!r} must be an int >= {lo}")  # fmt: skip
        if self.combine_dtype not in COMBINE_DTYPES:
            raise ConfigError(f"combine_dtype: {self.combine_dtype!r} must be bfloat16 or float32")
        if self.async_depth not in (1, 2):
            raise ConfigError(f"async_depth: {self.async_depth!r} must be 1 or 2")
        if self.lb_policy not in ("least_kv", "round_robin"):
            raise ConfigError(f"lb_policy: {self.lb_policy!r} must be least_kv or round_robin")
        if self.pin not in ("auto", "on", "off"):
            raise ConfigError(f"pin: {self.pin!r} must be auto, on or off")
        if self.num_blocks and self.num_blocks < self.blocks_per_seq:
            raise ConfigError(
                f"num_blocks: {self.num_blocks} blocks cannot hold one full context"
                f" ({self.blocks_per_seq} blocks of {self.block_size} tokens)"
            )

    def model_config(self) -> ModelConfig:
        return ModelConfig.preset(self.model, **self.model_overrides)

    @property
    def blocks_per_seq(self) -> int:
        return math.ceil(self.model_config().max_seq_len / self.block_size)

    @property
    def blocks(self) -> int:
        return self.num_blocks or self.max_num_seqs * self.blocks_per_seq

    def pod_config(self) -> PodConfig:
        m = self.model_config()
        return pod_config_for(
            m,
            self.dies,
            max_rows=self.max_num_batched_tokens,
            num_blocks=self.blocks,
            block_size=self.block_size,
            quant=self.quant,
            combine_dtype=self.combine_dtype,
            eplb=self.eplb,
            headroom_bytes=4 << 20,
            trace=bool(self.trace),
            serve_slot_bytes=self.slot_bytes(m),
            timeout_s=self.timeout_s,
            pin=self.pin,
        )

    def slot_bytes(self, m: ModelConfig) -> int:
        """A step frame's upper bound: every row's block table and tokens; a result's: sampled
        tokens and, when kept, their logits."""
        rows = self.max_num_seqs
        step = rows * (self.blocks_per_seq * 5 + 96) + self.max_num_batched_tokens * 5
        result = rows * 32 + (rows * m.vocab_size * 4 if self.keep_logits else 0)
        need = max(step, result) + 4096
        return max(64 << 10, -(-need // 4096) * 4096)


@dataclass
class CompletionOutput:
    """A finished request."""

    request_id: int
    prompt: str | list[int]
    token_ids: list[int]
    text: str
    finish_reason: str
    error: str = ""
    num_prompt_tokens: int = 0
    num_cached_tokens: int = 0
    group: int = -1
    ttft_s: float = 0.0
    e2e_s: float = 0.0

    @property
    def tpot_s(self) -> float:
        n = len(self.token_ids)
        return (self.e2e_s - self.ttft_s) / (n - 1) if n > 1 else 0.0


@dataclass
class Delta:
    """New tokens of a streamed request (`finish_reason` set on the last one). A rendered
    request's deltas carry `data` instead: the bytes for its client, `n_tokens` tokens' worth,
    `final` on its last bytes (which may come before the Delta with the finish reason)."""

    request_id: int
    token_ids: list[int]
    text: str
    finish_reason: str | None = None
    error: str = ""
    data: bytes = b""
    n_tokens: int = 0
    final: bool = False
    status: int = 200  # of a rendered response: 500 if the engine failed it, 503 if down


def _running_loop() -> asyncio.AbstractEventLoop | None:
    try:
        return asyncio.get_running_loop()
    except RuntimeError:
        return None


def _put_all(items: list) -> None:
    for q, delta in items:
        q.put_nowait(delta)


class _Tracked:
    """The engine's view of one request."""

    def __init__(self, rid: int, prompt, tokens: list[int], params: SamplingParams):
        self.id, self.prompt, self.tokens, self.params = rid, prompt, tokens, params
        self.out: list[int] = []
        self.group = -1
        self.t0 = time.monotonic()
        self.t_first = 0.0
        self.t_done = 0.0
        self.reason: str | None = None
        self.error = ""
        self.n_cached = 0
        self.done = threading.Event()
        self.listeners: list = []  # (loop, asyncio.Queue) of streams
        self.keep = False  # submit(): keep it after it finished, for result()
        self.pin: int | None = None  # a DP group chosen by the caller
        self.render: dict | None = None  # rendered for an HTTP client (runtime.openai_api)
        self.n_out = 0  # tokens generated (rendered: counted up to a stop string)
        self.t_sched = 0.0  # first planned (from the master)
        self.t_last = 0.0  # the last tokens arrived
        self.final = False  # a rendered request's last bytes went out

    @property
    def streamed(self) -> bool:
        """Does the master send tokens every step (else all of them with the finish)?"""
        if not self.listeners:
            return False
        r = self.render
        return r is None or bool(r.get("stream") or r.get("stop"))

    def output(self) -> CompletionOutput:
        return CompletionOutput(
            self.id, self.prompt, list(self.out), decode(self.out), self.reason or "error",
            self.error, len(self.tokens), self.n_cached, self.group,
            (self.t_first - self.t0) if self.t_first else 0.0, self.t_done - self.t0,
        )  # fmt: skip


class Engine:
    """A running serving engine. Build with `Engine.launch`; use as a context manager."""

    def __init__(self, config: EngineConfig):
        self.config = config
        self.model = config.model_config()
        self.pod: Pod | None = None
        self.run_dir = ""
        self.masters: list = []
        self.ctx: zmq.Context | None = None  # made after the masters are forked
        self.to_master: list = []
        self.inbox = None
        self.lock = threading.Lock()
        self.reqs: dict[int, _Tracked] = {}
        self.finished: dict[int, _Tracked] = {}  # of `submit`, until `result` takes them
        self.pending: deque[_Tracked] = deque()
        self.ids = itertools.count()
        limit = config.max_num_seqs + config.queue_ahead
        self.lb = LoadBalancer(config.dies, limit, config.blocks, config.block_size,
                               config.lb_policy)  # fmt: skip
        self.stats: dict[int, dict] = {}
        self.stats_log: list[dict] = []
        self.step_log: dict[int, list] = {}
        self.master_trace: dict[int, dict] = {}
        self.pod_result: list | None = None
        self.failure: BaseException | None = None
        self.closing = False
        self.drained = False  # close() sets it once no master can send anything more
        self.closed = False
        self.ready = threading.Semaphore(0)
        self._threads: list[threading.Thread] = []
        self.outputs: list = []  # output processes (output_procs)
        self.to_output: list = []
        self.render = OutputHandler()  # renders in this process when output_procs is off
        self.observer = None  # metrics: on_tokens(t, n, now), on_finish(t), on_stats(body)
        self.notes: dict = {}
        self.rx_loop: asyncio.AbstractEventLoop | None = None  # attach_loop
        self.rx_watch = None
        self.rx_handover = False  # event loop -> [(queue, Delta)] to hand over (`_deliver`)
        self.ping_seq = 0
        self.started_at = time.monotonic()
        self.pongs: dict[int, tuple[int, float, int]] = {}  # group -> (seq, when, die step)

    # -- launch ---------------------------------------------------------------------------------

    @classmethod
    def launch(cls, config: EngineConfig | None = None, **options) -> Engine:
        """Start the pod, the masters and the engine's threads; return when all are ready.

        Arguments: an EngineConfig, or its fields as keyword arguments (ConfigError if bad).
        """
        if config is None:
            config = EngineConfig(**options)
        elif options:
            raise TypeError("Engine.launch: pass an EngineConfig or keyword options, not both")
        eng = cls(config)
        try:
            eng._start()
        except BaseException:
            eng.close()
            raise
        return eng

    def _start(self) -> None:
        cfg = self.config
        pcfg = cfg.pod_config()
        with prepared_for_fork(cfg.model_config()):  # kernels and one copy of the weights
            self.pod = Pod.launch(pcfg)
        self.run_dir = f"/dev/shm/xpod.{self.pod.pod_id}.run"
        os.mkdir(self.run_dir, 0o700)
        for r in range(cfg.dies):
            Bell.create(bell_path(self.run_dir, f"d{r}"))
            Bell.create(bell_path(self.run_dir, f"m{r}"))
        ctx = mp.get_context("fork")
        for g in range(cfg.dies if cfg.output_procs else 0):
            p = ctx.Process(target=output_main, args=(OutputSpec(g, self.run_dir), os.getpid()),
                            name=f"xpod-{self.pod.pod_id}-output{g}", daemon=True)  # fmt: skip
            p.start()
            self.outputs.append(p)
        cpus = sorted(os.sched_getaffinity(0))
        pin_masters = cfg.pin == "on" or (cfg.pin == "auto" and 2 * cfg.dies <= len(cpus))
        for g in range(cfg.dies):
            spec = self._master_spec(g, pcfg, cpus[(cfg.dies + g) % len(cpus)] if pin_masters
                                     else -1)  # fmt: skip
            p = ctx.Process(target=master_main, args=(spec, os.getpid()),
                            name=f"xpod-{self.pod.pod_id}-master{g}", daemon=True)  # fmt: skip
            p.start()
            self.masters.append(p)
        self.ctx = zmq.Context()  # after the forks: a forked child must not inherit a context
        self.inbox = self.ctx.socket(zmq.PULL)
        self.inbox.bind(engine_socket(self.run_dir))
        for g in range(cfg.dies):
            s = self.ctx.socket(zmq.PUSH)
            s.setsockopt(zmq.LINGER, 0)
            s.connect(master_socket(self.run_dir, g))
            self.to_master.append(s)
        for g in range(len(self.outputs)):
            s = self.ctx.socket(zmq.PUSH)
            s.setsockopt(zmq.LINGER, 0)
            s.connect(output_socket(self.run_dir, g))
            self.to_output.append(s)
        serve = ServeSpec(self.model, cfg.protocol, cfg.quant, cfg.blocks, cfg.block_size,
                          self.run_dir, cfg.keep_logits, cfg.gc_every, cfg.eplb)  # fmt: skip
        self._thread(self._pod_loop, serve, name="xpod-pod-run")
        self._thread(self._receive, name="xpod-engine-receive")
        deadline = time.monotonic() + READY_TIMEOUT_S
        for _ in range(cfg.dies):
            if not self.ready.acquire(timeout=max(0.0, deadline - time.monotonic())):
                raise EngineError(f"masters not ready after {READY_TIMEOUT_S:g} s")
            if self.failure is not None:
                raise EngineError(f"engine failed while starting: {self.failure}")
        if cfg.warmup:
            warm = [self._track([1], SamplingParams(max_tokens=1), g) for g in range(cfg.dies)]
            for g, t in enumerate(warm):
                t.id = -1 - g  # the caller's request ids start at 0
            self.ids = itertools.count()
            self._enqueue(warm)
            for t in warm:
                if not t.done.wait(READY_TIMEOUT_S) or t.reason == "error":
                    raise EngineError(f"warm-up request failed: {t.error or 'timed out'}")

    def _master_spec(self, g: int, pcfg: PodConfig, cpu: int) -> MasterSpec:
        cfg, m = self.config, self.model
        return MasterSpec(
            group=g, pod_id=self.pod.pod_id, run_dir=self.run_dir, config=pcfg.to_dict(),
            vocab_size=m.vocab_size, eos_token_id=EOS, num_blocks=cfg.blocks,
            block_size=cfg.block_size, max_num_seqs=cfg.max_num_seqs,
            max_num_batched_tokens=cfg.max_num_batched_tokens, max_seq_len=m.max_seq_len,
            long_prefill_threshold=cfg.long_prefill_threshold, async_depth=cfg.async_depth,
            prefix_cache=cfg.prefix_cache, log_steps=cfg.log_steps, gc_every=cfg.gc_every,
            pin_cpu=cpu, trace=bool(cfg.trace), output_proc=cfg.output_procs,
            stream_interval=cfg.stream_interval,
        )  # fmt: skip

    def _thread(self, fn, *args, name: str) -> None:
        t = threading.Thread(target=fn, args=args, name=name, daemon=True)
        t.start()
        self._threads.append(t)

    # -- background threads ---------------------------------------------------------------------

    def _pod_loop(self, serve: ServeSpec) -> None:
        try:
            self.pod_result = self.pod.run(serve_main, serve)
        except BaseException as e:  # noqa: BLE001 - every failure ends the engine, named
            if not self.closing:
                self._fail(EngineError(f"the pod failed: {type(e).__name__}: {e}"))

    def _receive(self) -> None:
        poller = zmq.Poller()
        poller.register(self.inbox, zmq.POLLIN)
        watched = time.monotonic()
        while not self.rx_handover:
            ready = poller.poll(WATCH_EVERY_S * 1000)
            if time.monotonic() - watched >= WATCH_EVERY_S:
                watched = time.monotonic()
                self._watch()
            if not ready:
                if self.drained:  # close(): every master is gone and nothing is left to read
                    return
                continue
            self._read_inbox()

    def _read_inbox(self) -> None:
        while True:
            try:
                frame = self.inbox.recv(zmq.NOBLOCK)
            except (zmq.Again, zmq.ZMQError):
                return
            try:
                self._on_message(*wire.unpack(frame))
            except Exception as e:  # noqa: BLE001 - a bad frame must not stop the engine
                log.warning("engine: dropped a message: %s", e)

    # -- an event loop as the receiver ----------------------------------------------------------

    def attach_loop(self, loop: asyncio.AbstractEventLoop) -> None:
        """Read the masters' messages on `loop` (call from its thread) instead of the receiver
        thread: one wake-up per message instead of two (the thread's, then the loop's), and
        the deltas go to their streams without crossing threads. `detach_loop` gives it back.
        """
        if self.rx_loop is not None:
            return
        rx = next((t for t in self._threads if t.name == "xpod-engine-receive"), None)
        self.rx_handover = True
        if rx is not None:
            rx.join(2 * WATCH_EVERY_S + 1)
            self._threads.remove(rx)
        self.rx_loop = loop
        loop.add_reader(self.inbox.getsockopt(zmq.FD), self._on_readable)
        loop.call_soon(self._on_readable)  # what came before the reader was added
        self.rx_watch = loop.call_later(WATCH_EVERY_S, self._watch_tick)

    def _on_readable(self) -> None:
        # the zmq FD signals edges: read until the socket says there is nothing left
        while self.inbox is not None and self.inbox.getsockopt(zmq.EVENTS) & zmq.POLLIN:
            self._read_inbox()

    def _watch_tick(self) -> None:
        self._watch()
        if self.rx_loop is not None:
            self.rx_watch = self.rx_loop.call_later(WATCH_EVERY_S, self._watch_tick)

    def detach_loop(self) -> None:
        """Back to the receiver thread (call on the loop's thread, before the loop ends)."""
        loop = self.rx_loop
        if loop is None:
            return
        loop.remove_reader(self.inbox.getsockopt(zmq.FD))
        if self.rx_watch is not None:
            self.rx_watch.cancel()
        self.rx_loop = self.rx_watch = None
        self.rx_handover = False
        self._thread(self._receive, name="xpod-engine-receive")

    def _watch(self) -> None:
        if self.closing or self.failure is not None:
            return
        for g, p in enumerate(self.masters):
            if p.exitcode is not None:
                self._fail(EngineError(f"master {g} (pid {p.pid}) exited ({p.exitcode})"))
                return
        for g, p in enumerate(self.outputs):
            if p.exitcode is not None:
                self._fail(EngineError(f"output process {g} (pid {p.pid}) exited ({p.exitcode})"))
                return

    def _on_message(self, kind: str, body: dict) -> None:
        if kind == "ready":
            self.ready.release()
        elif kind == "out":
            self._on_out(body)
        elif kind == "stats":
            self.stats[body["group"]] = body
            self.stats_log.append(body)
            if self.observer is not None:
                self.observer.on_stats(body)
        elif kind == "pong":
            self.pongs[body["group"]] = (body["seq"], time.monotonic(), body.get("die_step", 0))
        elif kind == "log":
            self.step_log[body["group"]] = body["steps"]
            self.master_trace[body["group"]] = body.get("trace", {})

    def _on_out(self, body: dict) -> None:
        now = time.monotonic()
        with self.lock:
            if "data" not in body:  # from a master: render here what is rendered
                body, stops = self.render.process(body)
                for rid in stops:
                    t = self.reqs.get(rid)
                    if t is not None and t.group >= 0:
                        self.to_master[t.group].send(wire.pack("abort", {"id": rid}))
            for rid, toks in body["deltas"]:
                t = self.reqs.get(rid)
                if t is None:
                    continue
                self._tokens(t, len(toks), now)
                t.out.extend(toks)
                self._notify(t, Delta(rid, list(toks), decode(toks)))
            for rid, n, data, final, status in body["data"]:
                t = self.reqs.get(rid)
                if t is None:
                    continue
                self._tokens(t, n, now)
                t.final = t.final or final
                self._notify(t, Delta(rid, [], "", data=data, n_tokens=n, final=final,
                                      status=status))  # fmt: skip
            for rec in body["done"]:
                rid, reason, _n_prompt, n_cached, error, first = rec[:6]
                t = self.reqs.pop(rid, None)
                if t is None:
                    continue
                if first and not t.streamed:  # the master sent the tokens with the finish
                    t.t_first = first
                if len(rec) > 6:
                    t.t_sched = rec[6]
                self.lb.on_finish(rid)
                self._end(t, reason, error, now, n_cached)
                if t.keep:
                    self.finished[rid] = t
            self._dispatch_pending()
            self._deliver()

    def _tokens(self, t: _Tracked, n: int, now: float) -> None:
        if n and not t.t_first:
            t.t_first = now
        if n and self.observer is not None and t.streamed:
            self.observer.on_tokens(t, n, now)
        t.n_out += n
        if n:
            t.t_last = now

    def _end(self, t: _Tracked, reason: str, error: str, now: float, n_cached: int = 0) -> None:
        t.reason, t.error, t.t_done, t.n_cached = reason, error, now, n_cached
        if t.render is not None and not t.final:  # the engine ended it (error, abort, close)
            self.render.renderers.pop(t.id, None)
            r = Renderer(t.render, len(t.tokens))
            data = r.finish(reason, error)
            t.final = True
            status = 503 if self.failure is not None else (500 if error else 200)
            self._notify(t, Delta(t.id, [], "", data=data, final=True, status=status))
        self._notify(t, Delta(t.id, [], "", reason, error))
        t.done.set()
        if self.observer is not None and t.id >= 0:
            self.observer.on_finish(t)

    def _notify(self, t: _Tracked, delta: Delta) -> None:
        """Queue a delta for the request's streams (caller holds the lock; `_deliver` sends)."""
        for loop, q in t.listeners:
            self.notes.setdefault(loop, []).append((q, delta))

    def _deliver(self) -> None:
        """Hand the queued deltas to their event loops: one wake-up per loop, not per delta
        (none for the loop this runs on: `attach_loop`)."""
        notes, self.notes = self.notes, {}
        here = _running_loop()
        for loop, items in notes.items():
            if loop is here:
                _put_all(items)
                continue
            with contextlib.suppress(RuntimeError):  # that loop is closed: nobody listens
                loop.call_soon_threadsafe(_put_all, items)

    def _fail(self, err: BaseException) -> None:
        with self.lock:
            if self.failure is None:
                self.failure = err
            now = time.monotonic()
            for t in list(self.reqs.values()) + list(self.pending):
                if not t.done.is_set():
                    self._end(t, "error", str(err), now)
                if t.keep:
                    self.finished[t.id] = t
            self.reqs.clear()
            self.pending.clear()
            self._deliver()
        self.ready.release()

    # -- requests -------------------------------------------------------------------------------

    def submit(
        self,
        prompt: str | list[int],
        params: SamplingParams | None = None,
        group: int | None = None,
    ) -> int:
        """Queue one request; returns its id. ValueError / TypeError for a bad prompt or params
        (the engine keeps serving), EngineError if the engine is down. `group` sends it to that
        DP group, bypassing the balancer (experiments, tests)."""
        t = self._track(prompt, params, group)
        t.keep = True
        self._enqueue([t])
        return t.id

    def _enqueue(self, tracked: list[_Tracked]) -> None:
        with self.lock:
            self._check_up()
            for t in tracked:
                self.reqs[t.id] = t
                self.pending.append(t)
            self._dispatch_pending()

    def _track(self, prompt, params: SamplingParams | None, group: int | None = None) -> _Tracked:
        if group is not None and (
            isinstance(group, bool)
            or not isinstance(group, int)
            or not 0 <= group < self.config.dies
        ):
            raise ValueError(f"group {group!r} must be a DP group in [0, {self.config.dies})")
        params = params or SamplingParams()
        if not isinstance(params, SamplingParams):
            raise TypeError(f"params must be a SamplingParams, got {type(params).__name__}")
        params.validate(self.model.vocab_size)
        if isinstance(prompt, str):
            if not prompt:
                raise ValueError("prompt: empty (give at least one character)")
            tokens = encode(prompt)
        elif isinstance(prompt, list | tuple) and all(
            isinstance(x, int) and not isinstance(x, bool) for x in prompt
        ):
            tokens = list(prompt)
        else:
            raise TypeError("prompt must be a str or a list of token ids")
        if not tokens:
            raise ValueError("prompt: empty (give at least one token)")
        bad = [x for x in tokens if not 0 <= x < self.model.vocab_size]
        if bad:
            raise ValueError(
                f"prompt: token ids must be in [0, {self.model.vocab_size}), got {bad[:3]}"
            )
        limit = self.model.max_seq_len
        if len(tokens) + params.max_tokens > limit:
            raise ValueError(
                f"prompt ({len(tokens)} tokens) + max_tokens ({params.max_tokens}) exceeds the"
                f" context of {limit} tokens"
            )
        t = _Tracked(next(self.ids), prompt, tokens, params)
        t.pin = group
        return t

    def _check_up(self) -> None:
        if self.failure is not None:
            raise EngineError(f"the engine is down: {self.failure}")
        if self.closing or self.closed:
            raise EngineError("the engine is closed")

    def _dispatch_pending(self) -> None:
        """Send waiting requests to groups while the balancer finds room (caller holds lock)."""
        while self.pending:
            t = self.pending[0]
            g = t.pin if t.pin is not None else self.lb.pick(len(t.tokens), t.params.max_tokens)
            if g is None:
                return
            self.pending.popleft()
            self.lb.on_dispatch(g, t.id, len(t.tokens), t.params.max_tokens)
            t.group = g
            p = t.params
            body = {"id": t.id, "prompt": t.tokens, "stream": t.streamed,
                    "params": {"max_tokens": p.max_tokens, "temperature": p.temperature,
                               "seed": p.seed, "stop_token_ids": list(p.stop_token_ids),
                               "ignore_eos": p.ignore_eos}}  # fmt: skip
            if t.render is not None:
                if self.outputs:
                    body["render"] = t.render
                else:
                    self.render.open(t.id, t.render, len(t.tokens))
            self.to_master[g].send(wire.pack("add", body))

    def abort(self, request_id: int) -> None:
        """Abort a request (no-op if unknown or finished): it ends with finish reason "abort"."""
        with self.lock:
            t = self.reqs.get(request_id)
            if t is None:
                return
            if t in self.pending:
                self.pending.remove(t)
                self.reqs.pop(request_id, None)
                self._end(t, "abort", "", time.monotonic())
                self._deliver()
                if t.keep:
                    self.finished[t.id] = t
                return
            self.to_master[t.group].send(wire.pack("abort", {"id": request_id}))

    def result(self, request_id: int, timeout_s: float | None = None) -> CompletionOutput:
        """Wait for a request submitted with `submit`; TimeoutError after `timeout_s`."""
        with self.lock:
            t = self.reqs.get(request_id) or self.finished.get(request_id)
        if t is None:
            raise KeyError(f"unknown request id {request_id}")
        if not t.done.wait(timeout_s):
            raise TimeoutError(f"request {request_id}: not finished after {timeout_s} s")
        with self.lock:
            self.finished.pop(request_id, None)
        return t.output()

    def generate(self, prompts, params: SamplingParams | list[SamplingParams] | None = None,
                 timeout_s: float | None = None, group: int | None = None,
                 ) -> list[CompletionOutput]:  # fmt: skip
        """Run every prompt (a str, or a list of token ids; or a list of them) to completion;
        outputs in prompt order. One SamplingParams for all, or one per prompt; `group` as for
        `submit`. TimeoutError after `timeout_s` (the requests go on)."""
        single = isinstance(prompts, str) or (
            isinstance(prompts, list) and prompts and isinstance(prompts[0], int)
        )
        prompts = [prompts] if single else list(prompts)
        plist = params if isinstance(params, list) else [params] * len(prompts)
        if len(plist) != len(prompts):
            raise ValueError(f"params: {len(plist)} for {len(prompts)} prompts")
        tracked = [self._track(p, sp, group) for p, sp in zip(prompts, plist, strict=True)]
        self._enqueue(tracked)
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        for t in tracked:
            left = None if deadline is None else max(0.0, deadline - time.monotonic())
            if not t.done.wait(left):
                raise TimeoutError(f"generate: not finished after {timeout_s} s")
        return [t.output() for t in tracked]

    async def stream(self, prompt, params: SamplingParams | None = None, group: int | None = None,
                     render: dict | None = None):  # fmt: skip
        """Async generator of `Delta`s of one request, the last with `finish_reason`. Leaving
        the loop early (break, cancellation) aborts the request.

        `render`: a render spec (`runtime.openai_api.parse_*`, with its response `id`): the
        deltas then carry the bytes for an HTTP client (`Delta.data`), rendered by the output
        processes or by this process's receiver thread; the generator ends after the final
        bytes (their request may end a step later: a stop string is an abort)."""
        _, deltas = self.open_stream(prompt, params, group, render)
        async with contextlib.aclosing(deltas):
            async for delta in deltas:
                yield delta

    def open_stream(self, prompt, params: SamplingParams | None = None,
                    group: int | None = None, render: dict | None = None):  # fmt: skip
        """`stream`, with the request queued now (ValueError / TypeError / EngineError raised
        here): returns (request id, async generator of its Deltas). Call it on the event loop
        that iterates; closing the generator before the end aborts the request."""
        t = self._track(prompt, params, group)
        t.render = render
        q: asyncio.Queue = asyncio.Queue()
        t.listeners.append((asyncio.get_running_loop(), q))
        self._enqueue([t])
        return t.id, self._deltas(t, q)

    async def _deltas(self, t: _Tracked, q: asyncio.Queue):
        try:
            while True:
                delta = await q.get()
                yield delta
                if delta.finish_reason is not None or delta.final:
                    return
        finally:
            if not t.done.is_set() and not t.final:
                self.abort(t.id)

    def track_info(self, request_id: int) -> _Tracked | None:
        """The engine's record of a live request (None once finished)."""
        with self.lock:
            return self.reqs.get(request_id)

    def die_counters(self) -> dict[int, dict[int, int]]:
        """Per die, read now from its serving words (the shell launched the pod and maps every
        region): dummy steps, cumulative attention / MoE wait / forward ns, its step number.
        Fresh even for a group whose master sleeps ({} once the pod is closed)."""
        pod = self.pod
        if pod is None or pod.closed:
            return {}
        lo = pod.layout
        idx = {k: lo.serve_word(w) for k, w in (("dummy_steps", L.SV_DUMMY_STEPS),
               ("attn_ns", L.SV_ATTN_NS), ("moe_ns", L.SV_MOE_NS), ("step_ns", L.SV_STEP_NS),
               ("die_step", L.SV_VOTE_STEP))}  # fmt: skip
        if lo.eplb_layers:
            idx.update({k: lo.eplb_word(w) for k, w in (
                ("eplb_balance_ppm", L.EP_BALANCE_PPM), ("eplb_rows", L.EP_ROWS),
                ("eplb_moved_bytes", L.EP_MOVED_BYTES), ("eplb_move_ns", L.EP_MOVE_NS),
                ("eplb_switched", L.EP_SWITCHED))})  # fmt: skip
        out = {}
        for g in range(self.config.dies):
            try:
                words = pod.region(g).words
                out[g] = {k: int(words[i]) for k, i in idx.items()}
            except (PodError, IndexError, ValueError, TypeError):
                return {}
        return out

    # -- heartbeat ------------------------------------------------------------------------------

    def ping(self) -> int:
        """Send a heartbeat through every master's loop and its die's step loop; returns its
        sequence number. A group answers (`pongs[g]`) once its die echoed it."""
        with self.lock:
            self._check_up()
            self.ping_seq += 1
            for s in self.to_master:
                s.send(wire.pack("ping", {"seq": self.ping_seq}))
            return self.ping_seq

    def health(self, timeout_s: float) -> dict:
        """Per group: seconds since its last heartbeat answer, and whether that is within
        `timeout_s` (a group that never answered counts from the engine's start)."""
        now = time.monotonic()
        groups = {}
        for g in range(self.config.dies):
            seq, when, step = self.pongs.get(g, (0, self.started_at, 0))
            age = now - when
            groups[g] = {"age_s": round(age, 3), "ok": age <= timeout_s, "seq": seq,
                         "die_step": step}  # fmt: skip
        up = self.failure is None and not self.closing and not self.closed
        return {"ok": up and all(v["ok"] for v in groups.values()), "up": up, "groups": groups,
                "error": str(self.failure) if self.failure else ""}  # fmt: skip

    # -- teardown -------------------------------------------------------------------------------

    def close(self) -> None:
        """Abort what is left, stop masters and dies, remove every segment, socket and file."""
        if self.closed:
            return
        self.closing = True
        with self.lock, contextlib.suppress(zmq.ZMQError):
            for s in self.to_master:
                s.send(wire.pack("shutdown"), zmq.NOBLOCK)
        # After a failure the masters and dies may wait for each other: do not wait for long.
        deadline = time.monotonic() + (CLOSE_TIMEOUT_S if self.failure is None else 0.5)
        for p in self.masters:
            p.join(max(0.1, deadline - time.monotonic()))
        pod_run = next((t for t in self._threads if t.name == "xpod-pod-run"), None)
        if pod_run is not None:
            pod_run.join(max(0.1, deadline - time.monotonic()))
            if pod_run.is_alive() and self.pod is not None:
                # The dies did not all get their stop: abort their loop (parked dies see it
                # within PARK_POLL_S), so the pod run ends before the pod is closed from here.
                self.pod.abort()
                pod_run.join(CLOSE_TIMEOUT_S / 2)
        for p in self.masters:
            if p.is_alive():
                p.kill()
            p.join(5)
        with contextlib.suppress(zmq.ZMQError):  # they end at their master's eof, or now
            for s in self.to_output:
                s.send(wire.pack("shutdown"), zmq.NOBLOCK)
        for p in self.outputs:
            p.join(max(0.1, min(2.0, deadline - time.monotonic())))
            if p.is_alive():
                p.kill()
            p.join(5)
        self.drained = True  # the receiver reads what the masters sent last (final stats, logs)
        for t in self._threads:
            if t is not threading.current_thread() and t.name == "xpod-engine-receive":
                t.join(2)
        self._fail(EngineError("the engine is closed"))
        if self.config.trace and self.pod is not None and not self.pod.closed:
            self._write_trace(pod_run)
        if self.pod is not None:
            self.pod.close(fast=True)
        self.closed = True
        for t in self._threads:
            if t is not threading.current_thread():
                t.join(2)
        for s in [*self.to_master, *self.to_output, self.inbox]:
            if s is not None:
                s.close(linger=0)
        self.to_master, self.to_output, self.inbox = [], [], None
        if self.ctx is not None:
            self.ctx.term()
        if self.run_dir:
            shutil.rmtree(self.run_dir, ignore_errors=True)

    def _write_trace(self, pod_run) -> None:
        """Dies' records (the serving loop has ended) and masters' spans: one timeline."""
        from runtime.servetrace import write_serving_trace

        if pod_run is not None and pod_run.is_alive():
            log.warning("engine: the pod did not stop; no trace written")
            return
        try:
            dies = self.pod.trace_records()
        except PodError as e:
            log.warning("engine: no trace: %s", e)
            return
        n = write_serving_trace(self.config.trace, dies, self.master_trace)
        log.info("engine: wrote %d trace events to %s", n, self.config.trace)

    def __enter__(self) -> Engine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
