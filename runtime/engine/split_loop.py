"""The serving loop of a split pod's expert dies (MoE-attention disaggregation, 001 §5.2), and
what an attention die's loop (`runtime.engine.executor`) tells them.

An expert die runs one loop for the whole serving run, as in `xpod decode`
(`runtime.model.split.expert_loop`): A2E receive -> experts -> E2A, each call named by the
event id the attention dies put in the packets; no master, no command ring, no per-step message.

Idle: the attention dies vote among themselves and park when no group has work. Each one, before
it sleeps, stores `2s + 1` (parked after step s) in its word of every expert die's `parked`
serve words, and `2s` once it runs again (then it rings every die's bell). An expert die that
waits for its next A2E input checks those words in its own region (never a peer's): when every
attention die is parked it drains its bell, checks again and sleeps on it (no spinning, ~0 CPU),
until an attention die runs again or the input arrives. The attention dies' last A2E of the run
is the end marker (`runtime.model.split.END_EVENT`), followed by a bell ring.

Counters (cumulative, in the expert die's own serve words, read by the shell for `/metrics`):
a2e_ns, e2a_ns, idle_ns (waiting for A2E input), expert_ns (computing), a2e_calls.
"""

from __future__ import annotations

import time

import comm
from comm.alltoall import G_SEQ, Split
from comm.alltoall.state import a2a_state
from comm.routing import Placement
from comm.wait import Doze
from memory import layout as L
from memory.errors import PodAborted, ProtocolError
from runtime.engine.fault_hook import fault_hook
from runtime.engine.step_ring import Bell, bell_path
from runtime.model.die_model import DieModel
from runtime.model.expert_balancer import ExpertBalancer
from runtime.model.kv import PagedKV
from runtime.model.split import (
    build_split_model,
    end_experts,
    receive_call,
    run_experts,
    split_clock,
)
from runtime.model.weights import build_weights

PARK_POLL_S = 0.5  # a parked expert die looks at the launcher's abort word this often


class _Idle(Exception):
    """Every attention die is parked: the wait for input becomes a sleep on the bell."""


def notify_parked(die, split: Split, step: int, parked: bool) -> None:
    """An attention die's parked word in every expert die (a remote store, no read back)."""
    idx = die.layout.serve_word(L.SV_PARKED) + die.die_id
    value = 2 * step + 1 if parked else 2 * step
    for x in split.exp_dies:
        die.fab.publish(x, idx, value)  # a store on this host, a publish to another


class ExpertServer:
    """One expert die's serving loop (module docstring)."""

    def __init__(self, die, spec):
        self.die, self.spec, self.split = die, spec, spec.split
        cfg = spec.model
        self.bal = None
        if spec.eplb is None:
            self.model, _ = build_split_model(die, cfg, self.split, 0, spec.block_size)
            local = Placement.default(cfg.num_experts, self.split.exp_dies).experts_on(die.die_id)
            self.local = local.tolist()
        else:  # the balancer's bank holds the experts (runtime.model.expert_balancer)
            self.model = DieModel(cfg, build_weights(cfg, []), PagedKV.zeros(cfg.n_layers, 1, 1, 1))
            self.bal = ExpertBalancer(die, self.model, spec.eplb, members=self.split.exp_dies)
        # MoE event slots a step: the main layers, then MTP's k sub-forwards (every busy step
        # runs all k on every attention die, so the cycle stays in lockstep)
        k = spec.spec.k if spec.spec is not None else 0
        self.slots = cfg.n_layers + k
        self.per_step = (cfg.n_layers - cfg.n_dense_layers + k) * self.split.cycle  # calls a step
        lo = die.layout
        self.w = die.words[die.die_id]
        self.parked0 = lo.serve_word(L.SV_PARKED)
        self.n_att = len(self.split.att_dies)
        if self.n_att > L.MAX_PARKED:
            raise ProtocolError(f"a split serving pod has at most {L.MAX_PARKED} attention dies")
        self.words = {k: lo.serve_word(v) for k, v in (
            ("a2e", L.SV_A2E_NS), ("e2a", L.SV_E2A_NS), ("idle", L.SV_IDLE_NS),
            ("expert", L.SV_EXPERT_NS), ("calls", L.SV_A2E_CALLS))}  # fmt: skip
        self.bell = Bell(bell_path(spec.run_dir, f"d{die.die_id}"))
        self.clock = split_clock(die, cfg.kv_layers)
        self.clock.progress = (self.w, lo.serve_word(L.SV_PROGRESS))
        self.stats = {"die": die.die_id, "role": "expert", "calls": 0, "rows": 0, "parks": 0}
        # a kill / stop planned at a step: fired at its first call of that step (or later)
        mine = [f for f in spec.faults if f.index == die.die_id and f.phase == "step"]
        self.fault = fault_hook(die, mine) if mine else None

    def _input_word(self) -> tuple[int, int]:
        """(word index in this die's region, value) that the next A2E call waits for first."""
        sp, lo = self.split, self.die.layout
        op = a2a_state(self.die).fused_ops[0] + 1
        d = ((op - 1) % sp.cycle) // sp.microbatches
        mine = [a for a in sp.partners(self.die.die_id) if a in sp.domains[d]]
        if mine:  # a trampoline: its partner's A2E flag
            return (lo.a2e_flag_off + (op & 1) * L.FIELD_BYTES) // L.WORD + G_SEQ, op
        return lo.fused_flag_word(op & 1, sp.domains[d][0]) + G_SEQ, op

    def _all_parked(self) -> bool:
        w, p0 = self.w, self.parked0
        return all(w[p0 + a] & 1 for a in self.split.att_dies)

    def _probe(self) -> None:
        if self._all_parked():
            raise _Idle

    def wait_input(self) -> None:
        """Wait for the next A2E input; sleep on the bell while every attention die is parked."""
        idx, op = self._input_word()
        w = self.w
        while w[idx] < op:
            try:
                self.die.wait_ge(w, idx, op, -1, "a2e input", self._probe)
                return
            except _Idle:
                self._park(idx, op)

    def _park(self, idx: int, op: int) -> None:
        self.stats["parks"] += 1
        self.clock.mark(-1, 0, L.PROGRESS_STATES.index("park"))
        abort = self.die.ctx.abort
        w = self.w
        t0 = time.perf_counter_ns()
        doze = Doze(self.die.ctx.progress, PARK_POLL_S)  # attention dies on another host
        while True:
            self.bell.drain()  # before the checks: a ring after them wakes the wait below
            doze.look()  # their parked words and A2E input land only through it
            if w[idx] >= op or not self._all_parked():
                self.die.ctx.waited_ns += time.perf_counter_ns() - t0  # parked is waiting
                return
            if abort is not None and abort[0][abort[1]] != abort[2]:
                raise PodAborted(f"die {self.die.die_id}: aborted by the launcher while parked")
            doze.sleep(self.bell.wait)

    def run(self) -> dict:
        sp, quant = self.split, self.spec.quant
        die, w, k = self.die, self.w, self.words
        ctx = die.ctx
        comm.a2e_align(die, sp)
        policy = die.policy
        op_policy = policy.with_timeout(self.spec.op_timeout_s) if self.spec.op_timeout_s else None
        while True:
            t0, w0 = time.perf_counter_ns(), ctx.waited_ns
            self.clock.mark(-1, 2, L.PROGRESS_STATES.index("wait"))
            self.wait_input()
            if op_policy is not None:  # the rest of the call: the serving op deadline
                die.policy = op_policy
            try:
                got = receive_call(die, self.model, sp, quant, self.slots)
                if got is None:
                    break
                res, h, step, layer = got
                if self.fault is not None and step != self.clock.step:
                    self.fault(step, -1, "step")
                self.clock.step = step
                t1 = self.clock.span(2, layer, t0)
                waited = ctx.waited_ns - w0  # for its input, and for the forwarded flags
                local = self._local(layer, res.expert_counts)
                y = run_experts(self.model, layer, res, quant, local)
                t2 = self.clock.span(3, layer, t1)
                comm.e2a(die, y, h, event_id=None)
                t3 = self.clock.span(4, layer, t2)
                if self.bal is not None and (self.stats["calls"] + 1) % self.per_step == 0:
                    self.bal.end_step(self.stats["calls"] // self.per_step)
            finally:
                die.policy = policy
            w[k["idle"]] += waited
            w[k["a2e"]] += t1 - t0 - waited
            w[k["expert"]] += t2 - t1
            w[k["e2a"]] += t3 - t2
            w[k["calls"]] += 1
            self.stats["calls"] += 1
            self.stats["rows"] += int(len(res.x))
        comm.a2e_align(die, sp)
        if self.bal is not None:
            self.stats["eplb"] = self.bal.report()
        return self.stats

    def _local(self, layer: int, counts) -> list[int]:
        """The logical expert of each local slot (EPLB: the map in force; a busy step's first
        call starts the step on the balancer: moves and switches happen there, on every expert
        die at the same call)."""
        bal = self.bal
        if bal is None:
            return self.local
        b, pos = divmod(self.stats["calls"], self.per_step)
        if pos == 0:
            bal.begin_step(b)
        bal.record(layer, counts)
        return bal.local_ids(layer)

    def close(self) -> None:
        self.bell.close()
        if self.bal is not None:
            self.bal.close()


def expert_serve(die, spec) -> dict:
    """Run on an expert die of a split serving pod (one long pod.run, like `serve_main`)."""
    server = ExpertServer(die, spec)
    try:
        return server.run()
    finally:
        server.close()


def end_of_run(die, split: Split, quant, run_dir: str) -> None:
    """An attention die leaving the serving loop: the end marker to the expert dies (an empty
    A2E, no E2A), counters rounded to the cycle end, then a ring of every expert die's bell."""
    end_experts(die, split, quant)
    for x in split.exp_dies:
        bell = Bell(bell_path(run_dir, f"d{x}"))
        try:
            bell.ring()
        finally:
            bell.close()


__all__ = ["ExpertServer", "end_of_run", "expert_serve", "notify_parked"]
