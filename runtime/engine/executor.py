"""The die side of the serving engine (FlowServe's executor, vLLM's worker): the serving loop
(`serve_main`) that runs inside one long `pod.run` on every die, around the model's
`runtime.model.forward.forward` step.

Serving loop of die g, global step s = 1, 2, ... (the same numbers on every die):

1. command: take the next frame of the command ring if one is published; if the master has
   promised one (`cmd_promised > cmd_taken`), wait for it (the scheduling bubble); else none.
2. vote: rows of the command (0 without one), | EXIT once the master said stop; store
   vote_rows[s % 2], then vote_step = s LAST; then wait until every die voted s.
3. every die sums the same votes:
   - all EXIT: leave the loop (every die leaves at the same step);
   - sum 0: the pod is idle: answer an empty command, then PARK: drain the bell; leave the park
     when the ring has (or is promised) a command, or a peer voted beyond s; else sleep in
     `select` on the bell (no spinning, idle CPU ~0). A die that leaves the park for its own
     work votes s+1 first and then rings every peer's bell, so no die sleeps through a step
     that others vote for (a byte that arrives before the sleep makes it return at once);
     over hosts a peer's vote lands only through this die's fabric progress, which the park
     drives before each look, sleeping short after a ring (`comm.wait.Doze`);
   - else run step s: every die, a group without rows with an empty batch (a dummy step: every
     MoE layer is a pod-wide dispatch / combine, so nobody may skip a step).
4. result: sampled tokens (and the token fed to each decode row, the step, timings, logits if
   asked) to the result ring, then ring the master's bell.

MoE event ids are `s * n_layers + layer`, so they agree on every die. Decode rows carry no
token: the die feeds the request's last sampled token (asynchronous execution, 004 §4.2: the
master plans step n+1 before it knows step n's tokens).

Iteration rollback (001 §6.3 Stage 1, `ServeSpec.rollback`): a transient link fault (a
collective's `LinkError`, or a collective wait past `op_timeout_s`: a lost write) ends the run
on every die (the launcher aborts the others at once; the one that saw it rings every bell so
parked dies see the abort), and the launcher's resync realigns the collectives' operation
counters (a new generation: no flag of the aborted attempt satisfies the retry). Each die keeps
its loop (`_LOOPS`: model, KV, last tokens) and the commands of its last steps with the state
before each; the engine reads every die's `done_step` (`rollback_point`) and runs the loop
again from R = min + 1 (`serve_main(..., resume=R)`): each die re-runs from R the commands it
had taken, from the state it had before R, so the same rows in the same order give the same
tokens; results of steps a die had published are published again with their command's ring
`seq`, and the master drops the ones it has.
"""

from __future__ import annotations

import gc
import time
from collections import deque
from dataclasses import dataclass

import numpy as np

from comm.alltoall import Split
from comm.group import group_view
from comm.trace import STEP_NAMES, TRACK_NAMES
from comm.wait import Doze
from memory import layout as L
from memory.errors import LinkError, PeerTimeout, PodAborted, ProtocolError
from runtime.engine import wire
from runtime.engine.fault_hook import fault_hook
from runtime.engine.pd import KVThread, PDTopology
from runtime.engine.spec_step import spec_step_die
from runtime.engine.split_loop import end_of_run, expert_serve, notify_parked
from runtime.engine.step_ring import Bell, Ring, bell_path
from runtime.engine.votes import Votes
from runtime.model.config import ModelConfig
from runtime.model.expert_balancer import EPLBConfig, ExpertBalancer
from runtime.model.forward import PHASES, Clock, build_model, forward
from runtime.model.mtp import SpecConfig
from runtime.model.sampler import sample_rows
from runtime.model.split import attention_step, build_split_model, split_clock

SERVE_LANE = 98  # trace track of the serving loop (vote, park, step)
SERVE_OP = "serve"
STEP_NAMES.update({(SERVE_OP, 0): "wait command", (SERVE_OP, 1): "vote", (SERVE_OP, 2): "park",
                   (SERVE_OP, 3): "step", (SERVE_OP, 4): "result"})  # fmt: skip
TRACK_NAMES[SERVE_LANE] = "serve"

EXIT = 1 << 40  # vote flag: this die's master said stop
ROWS_MASK = EXIT - 1
PARK_POLL_S = 0.5  # a parked die looks at the launcher's abort word this often


class _Busy(Exception):
    """A vote wait ends early: some die has rows for this step."""


@dataclass(frozen=True)
class ServeSpec:
    """What every die needs to serve (picklable; sent once, with the long pod.run).

    Attributes:
        model: the toy model; protocol, quant: the MoE all-to-all.
        num_blocks, block_size: this die's KV pool (the master's KVManager has the same).
        run_dir: the pod's run directory (doorbells).
        keep_logits: return the logits of every sampled row (schedule replay).
        gc_every: 0 = Python's automatic GC; N = freeze after warm-up, collect every N steps.
        eplb: expert load balancing (`runtime.model.expert_balancer`), or None.
        rollback: keep the loop across a failed run for an iteration rollback (module doc).
        op_timeout_s: deadline of the step's collective waits (0: the pod's timeout_s).
        faults: die-side injected faults (`runtime.engine.faults.Fault` of kinds err, drop,
            delay); a die installs a hook only if one targets it.
        split: a split pod (MoE-attention disaggregation): the attention dies run this loop
            (voting among themselves), the expert dies `runtime.engine.split_loop`; or None.
        pd: a PD pod (`runtime.engine.pd`): each part votes and runs its all-to-all among its
            own dies (`comm.group_view`); prefill dies run a KV thread; decode dies have
            `decode_blocks` KV blocks (0: num_blocks). kv_timeout_s: the KV thread's deadline.
    """

    model: ModelConfig
    protocol: str
    quant: str | None
    num_blocks: int
    block_size: int
    run_dir: str
    keep_logits: bool = False
    gc_every: int = 0
    eplb: EPLBConfig | None = None
    rollback: bool = False
    op_timeout_s: float = 0.0
    faults: tuple = ()
    split: Split | None = None
    pd: PDTopology | None = None
    decode_blocks: int = 0
    kv_timeout_s: float = 60.0
    kv_checksum: bool = True
    spec: SpecConfig | None = None  # MTP speculative decoding (runtime.model.mtp), or None


class _Loop:
    """State of one die's serving loop (see the module docstring for the protocol)."""

    def __init__(self, die, spec: ServeSpec):
        self.die, self.spec = die, spec
        lo = die.layout
        self.split = spec.split
        self.me = die.die_id
        # the dies that vote: every die, a split pod's attention dies (dies 0..n_att-1), or
        # a PD pod's part (prefill or decode dies), whose all-to-all runs over a group view
        self.voters = list(range(die.num_dies if self.split is None
                                 else len(self.split.att_dies)))  # fmt: skip
        self.ep, self.kv_thread, n_blocks = die, None, spec.num_blocks
        if spec.pd is not None:
            self.voters = list(spec.pd.part(self.me))
            self.ep = group_view(die, self.voters)
            if spec.pd.role(self.me) == "decode" and spec.decode_blocks:
                n_blocks = spec.decode_blocks
        self.words = die.words
        self.votes = Votes(die, self.voters)
        self.promised = lo.serve_word(L.SV_CMD_PROMISED)
        self.dummy_word = lo.serve_word(L.SV_DUMMY_STEPS)
        self.ping, self.pong = lo.serve_word(L.SV_PING), lo.serve_word(L.SV_PONG)
        self.attn_word, self.moe_word = lo.serve_word(L.SV_ATTN_NS), lo.serve_word(L.SV_MOE_NS)
        self.step_word = lo.serve_word(L.SV_STEP_NS)
        self.mtp_word = lo.serve_word(L.SV_MTP_NS)
        self.cmds = Ring(die.region, "cmd", writer=False)
        self.results = Ring(die.region, "res", writer=True)
        self.bell = Bell(bell_path(spec.run_dir, f"d{self.me}"))
        bells = self.voters if spec.pd is not None else range(die.num_dies)
        self.peer_bells = [Bell(bell_path(spec.run_dir, f"d{p}")) for p in bells if p != self.me]
        self.master_bell = Bell(bell_path(spec.run_dir, f"m{self.me}"))
        if self.split is None:
            self.model, self.pool, self.bal = build_model(
                die, spec.model, n_blocks, spec.block_size, spec.eplb, ep=self.ep
            )
        else:
            self.model, self.pool = build_split_model(die, spec.model, self.split,
                                                      spec.num_blocks, spec.block_size)  # fmt: skip
            self.bal = _NoBalancer() if spec.eplb is None else ExpertBalancer(
                die, self.model, spec.eplb, members=self.split.exp_dies, router=True)  # fmt: skip
            self.a2e_word, self.e2a_word = lo.serve_word(L.SV_A2E_NS), lo.serve_word(L.SV_E2A_NS)
        self.clock = (
            Clock(die, spec.model.kv_layers)
            if self.split is None
            else split_clock(die, spec.model.kv_layers)
        )
        # Where this die is, for the shell's hang detector (runtime.engine.supervisor): the
        # clock stores (step, layer, phase ended) at every phase, the loop its vote / park.
        self.clock.progress = (self.words[self.me], lo.serve_word(L.SV_PROGRESS))
        self.words[self.me][lo.serve_word(L.SV_KV_POOL)] = die.region.offset_of(self.pool)
        self.kvf_word = lo.serve_word(L.SV_KV_FAULT)
        self.kvf_seq = 0
        self.bad: set[int] = set()  # KV blocks reported faulty: rows that hold one are dropped
        self.bad_new: list[int] = []  # not reported to the master yet
        # Early votes need a pod-wide collective in every busy step (an MoE layer).
        self.early = spec.model.n_dense_layers < spec.model.n_layers
        self.last: dict[int, int] = {}  # request -> its last sampled token (fed to decode rows)
        self.mtp = spec.spec if spec.spec is not None and spec.spec.k else None
        self.drafts: dict[int, list[int]] = {}  # MTP: request -> drafts for its next row
        self.transcripts: dict[int, list[int]] = {}  # MTP oracle / synthetic: their source
        if self.mtp is not None:
            self.clock.slots = spec.model.n_layers + self.mtp.k
        self.exiting = False
        self.stats = {"steps": 0, "dummy_steps": 0, "idle_votes": 0, "parks": 0, "rows": 0,
                      "bubble_ns": 0, "gc_collections": 0}  # fmt: skip
        self.prev_end = 0  # when the last result was published (bubble accounting)
        self.bubble = 0  # this step's: from the last result to having this step's command
        self.s = 0  # the global step
        self.history: deque = deque(maxlen=3)  # (step, cmd, last, steps) before each step run
        self.replay: deque = deque()  # steps to run again after a rollback
        self.done_word = lo.serve_word(L.SV_DONE_STEP)
        self.hits_word = lo.serve_word(L.SV_FAULT_HITS)
        self.fault_at_word = lo.serve_word(L.SV_FAULT_AT)
        self.policy = die.policy
        self.op_policy = die.policy.with_timeout(spec.op_timeout_s) if spec.op_timeout_s else None
        mine = [f for f in spec.faults if f.index == self.me]
        self.clock.fault = fault_hook(die, mine) if mine else None
        if spec.pd is not None and spec.pd.role(self.me) == "prefill":  # its KV transfers
            kv = [f for f in mine if f.phase == "kv"]
            self.kv_thread = KVThread(die, self.pool, spec.pd, spec.run_dir, spec.kv_timeout_s,
                                      fault_hook(die, kv) if kv else None,
                                      spec.kv_checksum)  # fmt: skip

    # -- one global step ----------------------------------------------------------------------

    def rewind(self, step: int) -> None:
        """An iteration rollback to `step`: run again the steps from it that this die had
        started, from the state it had before the first of them."""
        again = [h for h in self.history if h[0] >= step]
        self.replay = deque(again)
        if again:
            _, _, last, steps, drafts = again[0]
            self.last = dict(last)
            self.drafts = {r: list(d) for r, d in drafts.items()}
            self.stats["steps"] = steps
        self.s = step - 1
        self.exiting = False

    def take(self) -> dict | None:
        """The next command frame, waiting for a promised one; None without any. After a
        rollback, first the commands of the steps to run again."""
        if self.replay:
            return self.replay.popleft()[1]
        w, lo = self.words[self.me], self.die.layout
        taken = self.cmds.consumed()
        if not self.cmds.available() and w[self.promised] > taken:
            t0 = time.perf_counter_ns()
            self.die.wait_ge(w, lo.serve_word(L.SV_CMD_PUB), taken + 1, self.me,
                             "serve.cmd_pub (a command the master promised)")  # fmt: skip
            self.die.trace.rec(t0, time.perf_counter_ns() - t0, SERVE_OP, 0, -1, SERVE_LANE,
                               self.clock.step, 0)  # fmt: skip
        if not self.cmds.available():
            return None
        kind, body = wire.unpack(self.cmds.get(), {"step", "stop"})
        if kind == "stop":
            self.exiting = True
            return None
        body["seq"] = taken  # its ring index: a result published again after a rollback names it
        self.bubble = time.perf_counter_ns() - self.prev_end if self.prev_end else 0
        self.stats["bubble_ns"] += self.bubble
        return body

    def vote(self, s: int, rows: int) -> tuple[int, bool]:
        """Publish this die's vote for step s; (total rows seen, all exit).

        The step is busy as soon as one vote has rows, so a die with rows runs at once and a die
        without stops reading votes at the first busy one (the step's MoE collectives line the
        dies up anyway, which keeps the double-buffered vote words safe: nobody writes rows[s%2]
        again before every die finished step s). Only an idle or exiting step needs every vote.
        """
        t0 = time.perf_counter_ns()
        self.clock.step = s
        self.clock.mark(-1, 0, L.PROGRESS_STATES.index("vote"))
        votes, home = self.votes, self.words[self.me]
        votes.cast(s, rows | (EXIT if self.exiting else 0))
        if rows and self.early:
            return rows, False
        total, all_exit = 0, True
        for p in self.voters:
            sw = votes.step_word(p)
            if home[sw] < s:
                try:
                    self.die.wait_ge(home, sw, s, p, "serve.votes[p].step", self._busy(s))
                except _Busy:
                    total, all_exit = 1, False
                    break
            v = votes.rows(p, s)
            total += v & ROWS_MASK
            all_exit &= bool(v & EXIT)
            if total and self.early:
                break
        self.die.trace.rec(t0, time.perf_counter_ns() - t0, SERVE_OP, 1, -1, SERVE_LANE, s, total)
        return total, all_exit and not total

    def _busy(self, s: int):
        """A probe for the vote wait: raise _Busy once any die voted rows for step s."""
        if not self.early:
            return None
        home, votes = self.words[self.me], self.votes
        words = [(votes.step_word(p), votes.step_word(p) + 1 + (s & 1)) for p in self.voters]

        def probe() -> None:
            for vs, vr in words:
                if home[vs] >= s and home[vr] & ROWS_MASK:
                    raise _Busy

        return probe

    def park(self, s: int) -> bool:
        """Sleep until there is work for step s+1; True if this die's own work woke it (it must
        then ring its peers after voting)."""
        self.stats["parks"] += 1
        self.clock.step = s
        self.clock.mark(-1, 0, L.PROGRESS_STATES.index("park"))
        t0 = time.perf_counter_ns()
        abort = self.die.ctx.abort
        if self.split is not None:  # the expert dies may sleep once every attention die does
            notify_parked(self.die, self.split, s, True)
        # a voter on another host: its vote lands only through this die's fabric progress
        doze = Doze(self.die.ctx.progress, PARK_POLL_S)
        try:
            while True:
                self.bell.drain()
                doze.look()
                if self.heartbeat():
                    self.master_bell.ring()
                if (
                    self.cmds.available()
                    or self.words[self.me][self.promised] > self.cmds.consumed()
                ):
                    return True
                if self.votes.beyond(s):
                    return False
                if abort is not None and abort[0][abort[1]] != abort[2]:
                    raise PodAborted(f"die {self.me}: aborted by the launcher while parked")
                doze.sleep(self.bell.wait)
        finally:
            if self.split is not None:  # running again: before this die rings its peers
                notify_parked(self.die, self.split, s + 1, False)
            self.die.trace.rec(t0, time.perf_counter_ns() - t0, SERVE_OP, 2, -1, SERVE_LANE, s, 0)
            self.prev_end = 0  # time parked is not a scheduling bubble

    def heartbeat(self) -> bool:
        """Echo the master's heartbeat (`ping` -> `pong`); True if there was a new one. Called
        once per loop iteration and per park wake-up: a die stuck anywhere stops echoing."""
        w = self.words[self.me]
        p = w[self.ping]
        if p == w[self.pong]:
            return False
        w[self.pong] = p
        return True

    def kv_faults(self, rows: list[dict]) -> list[dict]:
        """A memory fault report in this die's `kv_fault` word (its own region): the block is
        poisoned (NaN in every layer: what reading it would give) and out of service here;
        rows whose table holds a bad block are dropped from the step (their requests are
        recomputed by the master, which masks the block when the result reports it)."""
        f = int(self.words[self.me][self.kvf_word])
        if f >> 32 != self.kvf_seq:
            block = (f & 0xFFFFFFFF) - 1
            if block < 0 and rows:
                block = rows[0]["table"][0]  # "a block in use": the first row's first block
            if block >= 0:
                self.kvf_seq = f >> 32
                self.bad.add(block)
                self.bad_new.append(block)
                self.pool[:, block] = np.nan
        if not self.bad:
            return rows
        return [r for r in rows if self.bad.isdisjoint(r["table"])]

    def run_step(self, s: int, cmd: dict | None) -> None:
        if self.clock.fault is not None:  # a kill / stop planned at this step fires first
            self.clock.fault(s, -1, "step")
        self.history.append((s, cmd, dict(self.last), self.stats["steps"],
                             {r: list(d) for r, d in self.drafts.items()}))  # fmt: skip
        rows = cmd["rows"] if cmd else []
        dropped = []
        if self.bad or self.words[self.me][self.kvf_word]:
            kept = self.kv_faults(rows)
            dropped = [r["id"] for r in rows if r not in kept]
            rows = kept
        for r in cmd["released"] if cmd else ():
            self.last.pop(r, None)
            self.drafts.pop(r, None)
            self.transcripts.pop(r, None)
        if self.mtp is not None:
            return spec_step_die(self, s, cmd, rows, dropped)
        segments, kv_rows, fed = [], [], []
        for r in rows:
            rid = r["id"]
            if r["tokens"] is None:
                if rid not in self.last:
                    raise ProtocolError(f"die {self.me}: decode row of request {rid}, which has"
                                        " no sampled token on this die")  # fmt: skip
                toks = [self.last[rid]]
                fed.append([rid, toks[0]])
            else:
                toks = r["tokens"]
            segments.append((rid, toks, r["start"]))
            kv_rows.append((rid, r["start"], len(toks), r["table"]))
        self.model.kv.begin_step(kv_rows)
        self.clock.step = s
        self.clock.cur = cur = [0] * len(PHASES)
        t0 = time.perf_counter_ns()
        busy = self.stats["steps"]  # the balancer's step: busy steps, the same on every die
        self.bal.begin_step(busy)
        if self.kv_thread is not None and self.kv_thread.error is not None:
            raise self.kv_thread.error
        if self.op_policy is not None:  # the collectives' waits: the op deadline
            self.die.policy = self.ep.policy = self.op_policy
        try:
            if self.split is None:
                logits = forward(self.ep, self.model, segments, self.spec.protocol,
                                 self.spec.quant, self.clock, self.bal)  # fmt: skip
            else:
                bal = None if self.spec.eplb is None else self.bal
                logits = attention_step(self.die, self.model, segments, self.split,
                                        self.spec.quant, self.clock, bal=bal)  # fmt: skip
        finally:
            self.die.policy = self.ep.policy = self.policy
        self.bal.end_step(busy)
        samp = [i for i, r in enumerate(rows) if r["sample"]]
        tokens = sample_rows(logits[samp], [rows[i] for i in samp]) if samp else []
        for i, tok in zip(samp, tokens, strict=True):
            self.last[rows[i]["id"]] = tok
        t1 = time.perf_counter_ns()
        self.account(s, rows, t0, t1, cur, sum(len(seg[1]) for seg in segments))
        if cmd is not None:
            body = {"plan": cmd["plan"], "seq": cmd["seq"], "step": s, "t0": t0, "t1": t1,
                    "sampled": [[rows[i]["id"], tok] for i, tok in zip(samp, tokens, strict=True)],
                    "fed": fed, "dummy_steps": self.stats["dummy_steps"],
                    "bubble_ns": self.bubble, "attn_ns": cur[0]}  # fmt: skip
            if self.spec.keep_logits and samp:
                body["logits"] = wire.pack_array(logits[samp])
            if dropped:
                body["dropped"] = dropped
            if self.bad_new:
                body["kv_fault"], self.bad_new = self.bad_new, []
            self.publish(body)

    def account(self, s: int, rows: list, t0: int, t1: int, cur: list, n_rows: int) -> None:
        """A step's counters and its serving-loop span (every step, speculative or not)."""
        self.stats["steps"] += 1
        self.stats["rows"] += n_rows
        w = self.words[self.me]
        w[self.attn_word] += cur[0]
        w[self.moe_word] += cur[2] + cur[4]
        w[self.step_word] += t1 - t0
        if self.split is not None:
            w[self.a2e_word] += cur[2]
            w[self.e2a_word] += cur[4]
        if not rows:
            self.stats["dummy_steps"] += 1
            w[self.dummy_word] = self.stats["dummy_steps"]
        self.die.trace.rec(t0, t1 - t0, SERVE_OP, 3, -1, SERVE_LANE, s, len(rows))

    def publish(self, body: dict) -> None:
        w, lo = self.words[self.me], self.die.layout
        if not self.results.can_put():
            need = self.results.published() - L.SERVE_SLOTS + 1
            self.die.wait_ge(w, lo.serve_word(L.SV_RES_TAKEN), need,
                             self.me, "serve.res_taken (the master reads results)")  # fmt: skip
        self.results.put(wire.pack("result", body))
        self.master_bell.ring()
        self.prev_end = time.perf_counter_ns()

    def run(self) -> dict:
        ring_peers = False
        gc_step = 0
        w = self.words[self.me]
        while True:
            self.s += 1
            s = self.s
            if self.heartbeat():
                self.master_bell.ring()
            if self.clock.fault is not None:  # a fault the shell fires at this step: it waits
                self.clock.fault(s, -1, "gate")
            cmd = self.take()
            total, all_exit = self.vote(s, len(cmd["rows"]) if cmd else 0)
            if ring_peers:  # this die left a park for its own work: wake the others
                for b in self.peer_bells:
                    b.ring()
                ring_peers = False
            if all_exit:
                break
            if total == 0:
                self.stats["idle_votes"] += 1
                if cmd is not None:
                    self.publish({"plan": cmd["plan"], "seq": cmd["seq"], "step": s, "t0": 0,
                                  "t1": 0, "sampled": [], "fed": [], "bubble_ns": 0,
                                  "dummy_steps": self.stats["dummy_steps"]})  # fmt: skip
                w[self.done_word] = s
                ring_peers = self.park(s)
                continue
            self.run_step(s, cmd)
            w[self.done_word] = s
            gc_step = self._gc(gc_step)
        if self.split is not None:  # the expert dies' end marker
            end_of_run(self.die, self.split, self.spec.quant, self.spec.run_dir)
        out = {"die": self.me, "last_step": s, **self.stats}
        if self.spec.eplb is not None:
            out["eplb"] = self.bal.report()
        return out

    def _gc(self, n: int) -> int:
        every = self.spec.gc_every
        if not every:
            return 0
        n += 1
        if n == 8:  # warm-up over: keep the long-lived objects out of every later collection
            gc.collect()
            gc.freeze()
            gc.disable()
        elif n % every == 0:
            gc.collect(1)
            self.stats["gc_collections"] += 1
        return n

    def close(self) -> None:
        if self.kv_thread is not None:
            self.kv_thread.close()
        for b in (self.bell, self.master_bell, *self.peer_bells):
            b.close()
        if self.spec.gc_every:
            gc.enable()
            gc.unfreeze()
        self.bal.close()
        self.die.free(self.pool)


class _NoBalancer:
    """A split pod's attention die without EPLB routes to the logical experts."""

    def begin_step(self, b: int) -> None:
        pass

    def end_step(self, b: int) -> None:
        pass

    def close(self) -> None:
        pass


_LOOPS: dict[str, _Loop] = {}  # a die's loop kept across a failed run (iteration rollback)
ROLLBACK_ERRORS = (LinkError, PeerTimeout, PodAborted)


def serve_main(die, spec: ServeSpec, resume: int | None = None) -> dict:
    """Run on every die (one long pod.run): the serving loop until every master says stop.
    Returns this die's counters (steps, dummy steps, parks, bubble, ...). `resume`: an
    iteration rollback to that step, with the loop the failed run left (module docstring)."""
    if spec.split is not None and die.die_id not in spec.split.att_dies:
        return expert_serve(die, spec)  # stateless: a rollback starts it again
    loop = _LOOPS.pop(spec.run_dir, None)
    if loop is not None and resume is not None:
        loop.rewind(resume)
    else:
        if loop is not None:
            loop.close()
        loop = _Loop(die, spec)
    keep = False
    try:
        return loop.run()
    except ROLLBACK_ERRORS:
        keep = spec.rollback
        for b in loop.peer_bells:  # parked peers wake and see the launcher's abort
            b.ring()
        raise
    finally:
        if keep:
            _LOOPS[spec.run_dir] = loop
        else:
            loop.close()


def rollback_point(die, spec: ServeSpec) -> int:
    """The last step this die finished (-1 without a kept loop): R = min over dies + 1. An
    expert die of a split pod keeps no step: it does not bound R."""
    if spec.split is not None and die.die_id not in spec.split.att_dies:
        return 1 << 62
    loop = _LOOPS.get(spec.run_dir)
    return int(loop.words[loop.me][loop.done_word]) if loop is not None else -1


def drop_loop(die, spec: ServeSpec) -> None:
    """Free a kept loop (the engine gave up on rolling back)."""
    loop = _LOOPS.pop(spec.run_dir, None)
    if loop is not None:
        loop.close()


__all__ = ["ServeSpec", "serve_main"]
