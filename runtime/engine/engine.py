"""The serving engine: a pod of dies running the executor loop, one master per DP group, and
the TE-shell role (DP load balancing, request bookkeeping) in the caller's process.

```python
from runtime.engine import Engine, SamplingParams
with Engine.launch(dies=4, model="small") as eng:
    for out in eng.generate(["hello", "the pod"], SamplingParams(max_tokens=32)):
        print(out.text, out.finish_reason)
    async for delta in eng.stream("a prompt", SamplingParams(max_tokens=64)):
        print(delta.text, end="")
```

Processes (all children of the caller; every one gone after `close`, Ctrl-C, SIGTERM or an
error): the dies of a `Pod` (one long `pod.run(serve_main)` on a thread of the caller), one
master process per die (`runtime.engine.master`) and, with output shortcutting, one output
process per die (`runtime.engine.output`). The caller's process keeps two threads: the pod run
and a receiver of the masters' messages. Requests go to masters as msgpack frames over zmq
`ipc://` sockets in the pod's owner-only run directory `/dev/shm/xpod.<pod>.run`; the per-step
hot path (master <-> die) is the shared-memory step ring (`runtime.engine.step_ring`).

This module starts and stops the processes; the books of the requests (which group,
tokens, streams, finishes) are `runtime.engine.tracker.RequestTracker`'s; what the supervisor
reads and the steps of a restart or a rollback are `runtime.engine.recovery`'s (a base class);
reading the masters' messages (a thread or an event loop) and watching that the masters live is
`runtime.engine.receiver`'s (a base class too).
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import multiprocessing as mp
import os
import shutil
import threading
import time
from collections.abc import AsyncIterator

import zmq

from memory.errors import PodError
from runtime.engine import wire
from runtime.engine.config import EngineConfig
from runtime.engine.executor import (
    ServeSpec,
)
from runtime.engine.faults import FaultPlan, parse_faults
from runtime.engine.master import MasterSpec, master_main
from runtime.engine.output import OutputSpec, output_main
from runtime.engine.pd_shell import PDRouter, pd_blocks, pd_master_spec
from runtime.engine.pool_shell import PoolShell
from runtime.engine.receiver import EngineReceiver
from runtime.engine.records import CompletionOutput, Delta, EngineError, TrackedRequest
from runtime.engine.recovery import EngineRecovery
from runtime.engine.spec_stats import check_transcript
from runtime.engine.split_stats import die_counters, eplb_counters, role_counters, split_summary
from runtime.engine.step_ring import Bell, bell_path
from runtime.engine.supervisor import Supervisor
from runtime.engine.tracker import RequestTracker
from runtime.engine.wire import engine_socket, master_socket, output_socket
from runtime.model import EOS
from runtime.model.forward import prepared_for_fork
from runtime.pod import Pod, PodConfig
from sched import LoadBalancer, SamplingParams

log = logging.getLogger(__name__)
READY_TIMEOUT_S = 60.0
CLOSE_TIMEOUT_S = 10.0

__all__ = ["Engine"]


class Engine(EngineReceiver, EngineRecovery):
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
        limit = config.max_num_seqs + config.queue_ahead
        balancer = LoadBalancer(config.dies, limit, config.blocks, config.block_size,
                                config.lb_policy)  # fmt: skip
        self.tracker = RequestTracker(self.model, config.dies, balancer, self._send,
                                      config.output_procs)  # fmt: skip
        self.tracker.pd = PDRouter(config) if config.pd is not None else None
        self.pool = PoolShell(self) if config.kv_pool is not None else None
        self.tracker.pool = self.pool
        if self.pool is not None and config.log_steps:
            self.tracker.prompts = {}
        self.lock = self.tracker.lock  # also guards the sockets to the masters
        self.stats: dict[int, dict] = {}
        self.stats_log: list[dict] = []
        self.step_log: dict[int, list] = {}
        self.master_trace: dict[int, dict] = {}
        self.pod_result: list | None = None
        self.closing = False
        self.drained = False  # close() sets it once no master can send anything more
        self.closed = False
        self.ready = threading.Semaphore(0)
        self._threads: list[threading.Thread] = []
        self.outputs: list = []  # output processes (output_procs)
        self.to_output: list = []
        self.rx_loop: asyncio.AbstractEventLoop | None = None  # attach_loop
        self.rx_watch = None
        self.rx_handover = False  # the receiver thread hands over to an event loop
        self.ping_seq = 0
        self.started_at = time.monotonic()
        self.pongs: dict[int, tuple[int, float, int]] = {}  # group -> (seq, when, die step)
        self.pod_id: str | None = None  # kept across restarts (the run directory is named so)
        self.recovering = False  # a restart is under way (admissions held, /health 503)
        self.alive_since = time.monotonic()  # the current incarnation's start (health ages)
        self.supervisor: Supervisor | None = None
        self.kv_fault_seq = 0
        self.rollbacks: list[dict] = []  # iteration rollbacks: step, attempt, error, seconds
        self.first_plan: FaultPlan | None = None
        self.not_fired: list = []  # (Fault, why) of the plan's faults that never fired (close)
        self.fault_arm: dict[int, list[int]] = {}  # die -> [at=T ordinal, gates released]
        self.steps_armed = False  # step faults may fire (after the warm-up)

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
        if cfg.inject:
            self.first_plan = FaultPlan(parse_faults(cfg.inject, cfg.dies, cfg.output_procs,
                                                     cfg.pod_dies, cfg.pool_servers))  # fmt: skip
        self._launch_pod()
        self.run_dir = f"/dev/shm/xpod.{self.pod.pod_id}.run"
        os.makedirs(self.run_dir, 0o700, exist_ok=True)  # an MPI pod made it already
        for r in range(cfg.pod_dies):
            Bell.create(bell_path(self.run_dir, f"d{r}"))
        for r in range(cfg.dies):
            Bell.create(bell_path(self.run_dir, f"m{r}"))
        self._fork_group_processes()
        self.ctx = zmq.Context()  # after the forks: a forked child must not inherit a context
        self.inbox = self.ctx.socket(zmq.PULL)
        self.inbox.bind(engine_socket(self.run_dir))
        self._connect_and_run()
        if cfg.warmup:
            warm = [self.tracker.track([1], SamplingParams(max_tokens=1), g)
                    for g in range(cfg.dies)]  # fmt: skip
            for g, t in enumerate(warm):
                t.id = -1 - g  # the caller's request ids start at 0
            self.tracker.ids = itertools.count()
            self.tracker.enqueue(warm)
            for t in warm:
                if not t.done.wait(READY_TIMEOUT_S) or t.reason == "error":
                    raise EngineError(f"warm-up request failed: {t.error or 'timed out'}")
        if self.pool is not None:  # after the warm-up: every die has made its KV pool
            self.pool.start()
        self.arm_steps()
        plan = self.first_plan
        self.started_at = time.monotonic()
        if cfg.recover or plan is not None:
            self.supervisor = Supervisor(self, plan, cfg.fault_log)
            self.supervisor.start()

    def _launch_pod(self) -> None:
        with prepared_for_fork(self.config.model_config()):  # kernels, one copy of the weights
            self.pod = Pod.launch(self.config.pod_config(), pod_id=self.pod_id)
        self.pod_id = self.pod.pod_id

    def _fork_group_processes(self) -> None:
        """The output processes and the masters of the current incarnation (`gen`)."""
        cfg, pcfg = self.config, self.config.pod_config()
        ctx = mp.get_context("fork")
        for g in range(cfg.dies if cfg.output_procs else 0):
            p = ctx.Process(target=output_main, args=(OutputSpec(g, self.run_dir), os.getpid()),
                            name=f"xpod-{self.pod.pod_id}-output{g}", daemon=True)  # fmt: skip
            p.start()
            self.outputs.append(p)
        cpus = sorted(os.sched_getaffinity(0))
        pin_masters = cfg.pin == "on" or (cfg.pin == "auto" and 2 * cfg.dies <= len(cpus))
        for g in range(cfg.dies):
            cpu = cpus[(cfg.dies + g) % len(cpus)] if pin_masters else -1
            if pcfg.die_cpus:  # a PD pod: each master on its part's core
                cpu = cpus[pcfg.die_cpus[g] % len(cpus)]
            spec = self._master_spec(g, pcfg, cpu)
            p = ctx.Process(target=master_main, args=(spec, os.getpid()),
                            name=f"xpod-{self.pod.pod_id}-master{g}", daemon=True)  # fmt: skip
            p.start()
            self.masters.append(p)

    def _check_launch(self) -> None:
        """A die or master that exited while the others start: an error now (the relaunch is
        tried again), not a wait for a readiness that cannot come."""
        for what, procs in (("die", self.pod.procs if self.pod else []), ("master", self.masters)):
            for i, p in enumerate(procs):
                # a Process, or a pod over hosts' mpirun (a Popen: poll, returncode)
                code = p.exitcode if hasattr(p, "exitcode") else p.poll()
                if code is not None:
                    raise EngineError(f"{what} {i} (pid {p.pid}) exited during the launch"
                                      f" (exit code {code})")  # fmt: skip

    def _connect_and_run(self) -> None:
        """Sockets to the masters and output processes, the pod run and (first time) the
        receiver thread; wait until every master of this incarnation is ready."""
        cfg = self.config
        with self.lock:  # the lock guards the sockets to the masters
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
        plan = self.supervisor.plan if self.supervisor is not None else self.first_plan
        # EPLB moves experts between dies across steps: a step of a move is not re-run (a
        # link fault with EPLB on is a restart)
        rollback = cfg.rollback and cfg.eplb is None
        serve = ServeSpec(self.model, cfg.protocol, cfg.quant, cfg.blocks, cfg.block_size,
                          self.run_dir, cfg.keep_logits, cfg.gc_every, cfg.eplb, rollback,
                          cfg.op_timeout_s if rollback else 0.0,
                          plan.unfired_die_side(self.gen) if plan is not None else (),
                          cfg.split, cfg.pd, cfg.decode_blocks, cfg.timeout_s,
                          cfg.kv_checksum, cfg.speculative)  # fmt: skip
        self._thread(self._pod_loop, serve, self.gen, name="xpod-pod-run")
        if not any(t.name == "xpod-engine-receive" for t in self._threads) and not (
            self.rx_handover
        ):
            self._thread(self._receive, name="xpod-engine-receive")
        deadline = time.monotonic() + READY_TIMEOUT_S
        for _ in range(cfg.dies):
            while not self.ready.acquire(timeout=min(0.1, max(0.0, deadline - time.monotonic()))):
                if time.monotonic() >= deadline:
                    raise EngineError(f"masters not ready after {READY_TIMEOUT_S:g} s")
                self._check_launch()
            if self.failure is not None:
                raise EngineError(f"engine failed while starting: {self.failure}")

    def _master_spec(self, g: int, pcfg: PodConfig, cpu: int) -> MasterSpec:
        cfg, m = self.config, self.model
        return MasterSpec(
            group=g, pod_id=self.pod.pod_id, run_dir=self.run_dir, config=pcfg.to_dict(),
            gen=self.gen,
            vocab_size=m.vocab_size, eos_token_id=EOS, num_blocks=pd_blocks(cfg, g),
            block_size=cfg.block_size, max_num_seqs=cfg.max_num_seqs,
            max_num_batched_tokens=cfg.max_num_batched_tokens, max_seq_len=m.max_seq_len,
            long_prefill_threshold=cfg.long_prefill_threshold, async_depth=cfg.async_depth,
            prefix_cache=cfg.prefix_cache, log_steps=cfg.log_steps, gc_every=cfg.gc_every,
            pin_cpu=cpu, trace=bool(cfg.trace), output_proc=cfg.output_procs,
            stream_interval=cfg.stream_interval, pd=pd_master_spec(cfg, g),
            spec_tokens=cfg.speculative.k if cfg.speculative is not None else 0,
            pool=self.pool.master_spec(g) if self.pool is not None else None,
        )  # fmt: skip

    def _thread(self, fn, *args, name: str) -> None:
        t = threading.Thread(target=fn, args=args, name=name, daemon=True)
        t.start()
        self._threads.append(t)

    def _send(self, group: int, kind: str, body: dict) -> None:
        """A message to `group`'s master (caller holds the lock: zmq sockets are not shared
        between threads). Dropped while a restart replaces the masters (what it said is in the
        tracker's books: an abort marks its request, a dispatch waits for the new masters)."""
        if group < len(self.to_master):
            self.to_master[group].send(wire.pack(kind, body))

    def _fail(self, err: BaseException) -> None:
        self.tracker.fail(err)
        self.ready.release()  # a launch waiting for the masters gives up at once

    # -- requests (the books are the tracker's: runtime.engine.tracker) --------------------------

    def submit(
        self,
        prompt: str | list[int],
        params: SamplingParams | None = None,
        group: int | None = None,
        transcript: list[int] | None = None,
        cache_salt: str | None = None,
    ) -> int:
        """Queue one request; returns its id. ValueError / TypeError for a bad prompt or params
        (the engine keeps serving), EngineError if the engine is down. `group` sends it to that
        DP group, bypassing the balancer (experiments, tests). `transcript`: with MTP's oracle
        / synthetic drafts, the request's own tokens by output index (a run without MTP).
        `cache_salt`: its prefix-cache namespace (`RequestTracker.track`'s ns)."""
        t = self.tracker.track(prompt, params, group, cache_salt)
        t.transcript = self._transcript(transcript)
        t.keep = True
        self.tracker.enqueue([t])
        return t.id

    def _transcript(self, tr) -> list[int] | None:
        return check_transcript(tr, self.config.speculative, self.model.vocab_size)

    def abort(self, request_id: int) -> None:
        """Abort a request (no-op if unknown or finished): it ends with finish reason "abort"."""
        self.tracker.abort(request_id)

    def result(self, request_id: int, timeout_s: float | None = None) -> CompletionOutput:
        """Wait for a request submitted with `submit`; TimeoutError after `timeout_s`."""
        return self.tracker.result(request_id, timeout_s)

    def generate(self, prompts, params: SamplingParams | list[SamplingParams] | None = None,
                 timeout_s: float | None = None, group: int | None = None,
                 transcripts: list[list[int]] | None = None, cache_salt: str | None = None,
                 ) -> list[CompletionOutput]:  # fmt: skip
        """Run every prompt (a str, or a list of token ids; or a list of them) to completion;
        outputs in prompt order. One SamplingParams for all, or one per prompt; `group` and
        `cache_salt` (all of them) as for `submit`; `transcripts` one per prompt as for
        `submit`. TimeoutError after `timeout_s` (the requests go on)."""
        single = isinstance(prompts, str) or (
            isinstance(prompts, list) and prompts and isinstance(prompts[0], int)
        )
        prompts = [prompts] if single else list(prompts)
        plist = params if isinstance(params, list) else [params] * len(prompts)
        if len(plist) != len(prompts):
            raise ValueError(f"params: {len(plist)} for {len(prompts)} prompts")
        tracked = [self.tracker.track(p, sp, group, cache_salt)
                   for p, sp in zip(prompts, plist, strict=True)]  # fmt: skip
        if transcripts is not None:
            if len(transcripts) != len(tracked):
                raise ValueError(f"transcripts: {len(transcripts)} for {len(tracked)} prompts")
            for t, tr in zip(tracked, transcripts, strict=True):
                t.transcript = self._transcript(tr)
        self.tracker.enqueue(tracked)
        self.tracker.wait_all(tracked, timeout_s)
        return [t.output() for t in tracked]

    async def stream(self, prompt, params: SamplingParams | None = None, group: int | None = None,
                     render: dict | None = None, cache_salt: str | None = None,
                     ) -> AsyncIterator[Delta]:  # fmt: skip
        """Async generator of `Delta`s of one request, the last with `finish_reason`. Leaving
        the loop early (break, cancellation) aborts the request.

        `render`: a render spec (`runtime.api.protocol.parse_*`, with its response `id`): the
        deltas then carry the bytes for an HTTP client (`Delta.data`), rendered by the output
        processes or by this process's receiver thread; the generator ends after the final
        bytes (their request may end a step later: a stop string is an abort)."""
        _, deltas = self.open_stream(prompt, params, group, render, cache_salt)
        async with contextlib.aclosing(deltas):
            async for delta in deltas:
                yield delta

    def open_stream(self, prompt, params: SamplingParams | None = None,
                    group: int | None = None, render: dict | None = None,
                    cache_salt: str | None = None,
                    ) -> tuple[int, AsyncIterator[Delta]]:  # fmt: skip
        """`stream`, with the request queued now (ValueError / TypeError / EngineError raised
        here): returns (request id, async generator of its Deltas). Call it on the event loop
        that iterates; closing the generator before the end aborts the request. `cache_salt`
        as for `submit`."""
        t = self.tracker.track(prompt, params, group, cache_salt)
        t.render = render
        return t.id, self.tracker.open_stream(t)

    def track_info(self, request_id: int) -> TrackedRequest | None:
        """The engine's record of a live request (None once finished)."""
        return self.tracker.info(request_id)

    def num_waiting(self) -> int:
        """Requests the engine holds because every group is at its limit."""
        return len(self.tracker.pending)

    @property
    def failure(self) -> BaseException | None:
        """Why the engine is down (None while it serves)."""
        return self.tracker.failure

    @property
    def observer(self):
        """Metrics hooks: `on_tokens(t, n, now)`, `on_finish(t)`, `on_stats(body)` (or None)."""
        return self.tracker.observer

    @observer.setter
    def observer(self, obs) -> None:
        self.tracker.observer = obs

    def split_stats(self) -> dict | None:
        """A split pod's per-role time shares, expert idle share and A2E / E2A ms per step,
        read now (None when colocated or closed; `runtime.engine.split_stats`)."""
        m, k = self.model, getattr(self.config.speculative, "k", 0)  # MTP: k sub-forwards more
        return split_summary(role_counters(self.pod, self.config.split),
                             m.n_layers - m.n_dense_layers + k, self.config.split)  # fmt: skip

    def eplb_counters(self) -> dict[int, dict[str, int]]:
        """Per die that hosts experts (a split pod's expert dies, else every die), its EPLB
        words read now ({} without EPLB or once closed; `runtime.engine.split_stats`)."""
        return eplb_counters(self.pod, self.config.split, self.config.dies)

    def die_counters(self) -> dict[int, dict[int, int]]:
        """Per die, read now from its serving words (the shell launched the pod and maps every
        region): dummy steps, cumulative attention / MoE wait / forward ns, its step number.
        Fresh even for a group whose master sleeps ({} once the pod is closed)."""
        return die_counters(self.pod, self.config.dies)

    # -- heartbeat ------------------------------------------------------------------------------

    def ping(self) -> int:
        """Send a heartbeat through every master's loop and its die's step loop; returns its
        sequence number. A group answers (`pongs[g]`) once its die echoed it."""
        with self.lock:
            self.tracker.check_up()
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
            seq, when, step = self.pongs.get(g, (0, self.alive_since, 0))
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
        if self.supervisor is not None:
            self.supervisor.quiesce()  # a restart under way finishes first
            self.open_gates()  # a die waiting for a fault to fire goes on without it
        with self.lock, contextlib.suppress(zmq.ZMQError):
            self.tracker.accepting = False
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
        if self.supervisor is not None:  # the plan's faults that never fired, and why
            self.not_fired = self.supervisor.finish(time.monotonic() - self.started_at)
        if self.config.trace and self.pod is not None and not self.pod.closed:
            self._write_trace(pod_run)
        if self.pool is not None:  # after the masters: no load or store is left to answer
            self.pool.close()
        if self.pod is not None:
            self.pod.close(fast=True)
        self.closed = True
        if self.supervisor is not None:  # its thread forked the processes of a restart: it
            self.supervisor.close()  # ends only now that they are gone
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
        from runtime.engine.trace import write_serving_trace

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
