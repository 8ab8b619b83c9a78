"""Expert load balancing in a running pod (EPLB; the placement policies are `sched.eplb`, the
request balancer between DP groups is `sched.lb`).

Glossary (vLLM's, as in `sched.eplb`): a *logical* expert is one of the model's E experts of an
MoE layer; a *physical* slot is one of the `P = E + dies * redundant_per_die` expert weights the
dies hold, `S = P / dies` per die; slot `p` is local slot `p % S` of die `p // S`. The pod is
laid out for P experts (`PodConfig.num_experts = P`), so `comm` sees an ordinary block placement
of physical experts and needs no change: a die maps its tokens' logical experts to physical
slots before `dispatch` (`route`: replica `(row + die + step) % replicas`, `sched.eplb.replica_for`
over `sched.eplb.row_positions`), and runs each local slot's expert on the rows it receives.

What each die does, in the order of a step (`begin_step(b)`, the forward, `end_step(b)`; `b` is
the busy-step number, the same on every die: a serving pod's idle votes do not count):

1. **Load recording** (001 §4.5 "load collection", part 3). `record` adds the rows each local
   slot received in a layer (`DispatchResult.expert_counts`) to row `b % window` of the die's
   count ring in its own metadata area (`memory.layout`, eplb block); `end_step` then publishes
   `count_step = b + 1` (steps complete). That is one small add per MoE layer: no message, no wait.
2. **Planning** (the leader, die 0, at the end of step `b_k` = the last step of window k). The
   window of plan k is the `every` steps since the map in force was switched to. The leader waits
   for every die's `count_step > b_k` (every die writes it before its next collective), reads
   the rows straight from the dies' metadata areas and maps slots to logical experts through
   the map in force. Its load estimate is each step's share of rows per logical expert (every
   step weighs the same: a prefill step's many prompt rows do not drown the decode steps, whose
   routing differs), summed over the window, plus `decay` x the previous estimate. It runs the
   policy (`sched.eplb.plan`) on that estimate, reorders the result's die blocks so that dies
   keep what they hold (`sched.eplb.keep_in_place`), and publishes the new phy2log in its own plan
   area, `plan_step` and then `plan_seq = k` LAST.
3. **Moving** (part 4). From step `b_k + 2` (by then every die has seen plan k: it finished step
   `b_k + 1`, whose collectives needed the leader, which published before starting that step),
   at the start of step `b_k + 2 + j` every die moves the experts of MoE layer j: for each slot
   whose new expert the die does not already hold, it receives that expert's three matrices
   from a die that holds it (the holders in turn), zero-copy over p2p straight into a free
   buffer of its bank; the old map keeps serving meanwhile (the moved expert lands in a buffer
   no slot uses). Every die derives the same move list from the two maps, so the pairs' message
   orders agree. After its last layer a die publishes `ready = k`.
4. **Switching**. At the start of step `b_k + 2 + layers`, every die waits for every die's
   `ready >= k`, then switches: slot tables, routing and expert weights change together, on
   every die at the same step. A die that dies or hangs while moving makes the others' move or
   ready wait fail (PodAborted / PeerTimeout): the pod fails, and no die switches, because a die
   switches only after every die said ready.

The expert bank: per MoE layer a pool of `2 S` expert buffers in the die's app area (3 x hidden
x moe_inter float32 each: gate, up, down), `S` in use; a move only fills unused buffers, so a
layer never needs more than `2 S`.

Trace (track "eplb"): the leader's "wait counts" and "plan" slices (a plan's `bytes` argument is
the balancedness of its window x 1e6), every die's "move" per layer (`bytes` received, with the
zero-copy p2p steps beside it) and "switch".

Without EPLB (`eplb=None`) the same object only records the per-step counts (for the decode
report) and routes logical ids unchanged over the default placement.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import numpy as np

import comm
from comm.routing import Placement
from comm.trace import STEP_NAMES, TRACK_NAMES
from memory import layout as L
from memory.errors import ConfigError, ProtocolError
from runtime.model.config import ModelConfig
from runtime.model.die_model import DieModel
from runtime.model.weights import FFNWeights, expert_ffn
from sched.eplb import POLICIES, ExpertMap, keep_in_place, plan, replica_for, row_positions

__all__ = ["EPLBConfig", "ExpertBalancer", "bank_bytes", "initial_map", "move_list"]

LEADER = 0
EVENT_BASE = 1 << 61  # p2p event ids of expert moves: + (plan * 4096 + layer) << 16 + index
EPLB_LANE = 97
TRACE_OP = "eplb"
STEP_NAMES.update({(TRACE_OP, 0): "plan", (TRACE_OP, 1): "move", (TRACE_OP, 2): "switch",
                   (TRACE_OP, 3): "wait counts"})  # fmt: skip
TRACK_NAMES[EPLB_LANE] = "eplb"


@dataclass(frozen=True)
class EPLBConfig:
    """Expert load balancing of a pod.

    Attributes:
        redundant_per_die: redundant slots per die (>= 0); every die has `E / dies + this`.
        every: steps per load window; a plan is made at the end of every window (>= 1).
        policy: "greedy" (001 §4.5) or "deepseek" (deepseek-ai/EPLB), `sched.eplb.plan`.
        num_groups, num_nodes: the "deepseek" policy's hierarchy (1, 1: global).
        dies_per_node: > 0 makes "nodes" of that many consecutive dies on this one host: the
            "deepseek" policy then places each of the model's `n_group` expert groups (all its
            replicas) on one node (num_groups = n_group, num_nodes = dies / dies_per_node), so
            a token of group-limited routing touches at most `topk_group` nodes. 0: one node.
        max_plans: stop planning after this many plans (0: never stop).
        decay: weight of the previous estimate when a window is added (0: the last window only,
            1: every window since the start alike).
        maps: forced plans instead of the policy: plan k publishes `maps[k - 1]` (a phy2log
            `[moe layers][P]`); no plan after the last. For tests and schedule replays.
    """

    redundant_per_die: int = 1
    every: int = 8
    policy: str = "greedy"
    num_groups: int = 1
    num_nodes: int = 1
    max_plans: int = 0
    decay: float = 0.5
    dies_per_node: int = 0
    maps: tuple = ()

    def __post_init__(self) -> None:
        for name, lo in (("redundant_per_die", 0), ("every", 1), ("num_groups", 1),
                         ("num_nodes", 1), ("max_plans", 0), ("dies_per_node", 0)):  # fmt: skip
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < lo:
                raise ConfigError(f"eplb {name}: expected an int >= {lo}, got {v!r}")
        if (
            isinstance(self.decay, bool)
            or not isinstance(self.decay, int | float)
            or not (0 <= self.decay <= 1)
        ):
            raise ConfigError(f"eplb decay: expected a number in [0, 1], got {self.decay!r}")
        if self.policy not in POLICIES:
            raise ConfigError(f"eplb policy: expected one of {POLICIES}, got {self.policy!r}")

    @property
    def window(self) -> int:
        """Rows of each die's count ring: a window, plus the steps a die may run ahead."""
        return self.every + 2

    def num_plans(self) -> int | None:
        """How many plans will be made (None: no limit)."""
        if self.maps:
            return len(self.maps) if not self.max_plans else min(len(self.maps), self.max_plans)
        return self.max_plans or None

    def physical(self, cfg: ModelConfig, num_dies: int) -> int:
        """Physical slots P = E + dies * redundant_per_die."""
        return cfg.num_experts + num_dies * self.redundant_per_die

    def hierarchy(self, cfg: ModelConfig, num_dies: int) -> tuple[int, int]:
        """(num_groups, num_nodes) for `sched.eplb.plan` (ConfigError if `dies_per_node` cannot
        give every node whole expert groups)."""
        dpn = self.dies_per_node
        if not dpn:
            return self.num_groups, self.num_nodes
        if self.policy != "deepseek":
            raise ConfigError("eplb dies_per_node: nodes are placed by the 'deepseek' policy")
        if num_dies % dpn:
            raise ConfigError(f"eplb dies_per_node: {num_dies} dies do not split into nodes"
                              f" of {dpn}")  # fmt: skip
        nodes = num_dies // dpn
        if cfg.n_group % nodes:
            raise ConfigError(f"eplb dies_per_node: {nodes} nodes cannot each hold whole expert"
                              f" groups of the model's n_group={cfg.n_group}")  # fmt: skip
        return cfg.n_group, nodes

    def check(self, cfg: ModelConfig, num_dies: int) -> None:
        """ConfigError unless this EPLB works for `cfg` on `num_dies` dies (before launch)."""
        n_moe = cfg.n_layers - cfg.n_dense_layers
        if n_moe < 1:
            raise ConfigError("eplb: the model has no MoE layer to balance")
        self.hierarchy(cfg, num_dies)
        try:
            initial_map(cfg, num_dies, self)
        except ValueError as e:
            raise ConfigError(f"eplb: {e}") from None
        for k, phy2log in enumerate(self.maps):
            try:
                ExpertMap.from_phy2log(phy2log, cfg.num_experts, num_dies)
                shape = np.asarray(phy2log).shape
            except (ValueError, TypeError) as e:
                raise ConfigError(f"eplb maps[{k}]: {e}") from None
            if shape != (n_moe, self.physical(cfg, num_dies)):
                raise ConfigError(
                    f"eplb maps[{k}]: expected shape ({n_moe}, "
                    f"{self.physical(cfg, num_dies)}), got {shape}"
                )


def initial_map(cfg: ModelConfig, num_dies: int, eplb: EPLBConfig) -> ExpertMap:
    """The map a pod starts with: the policy's placement for a uniform load (every expert once
    on its default die when there is no redundancy)."""
    n_moe = cfg.n_layers - cfg.n_dense_layers
    groups, nodes = eplb.hierarchy(cfg, num_dies)
    if eplb.redundant_per_die == 0:  # the block placement: whole groups per node too
        return ExpertMap.identity(n_moe, cfg.num_experts, num_dies)
    start = plan(np.ones((n_moe, cfg.num_experts)), num_dies, eplb.redundant_per_die,
                 eplb.policy, groups, nodes)  # fmt: skip
    return ExpertMap.from_phy2log(start.phy2log, cfg.num_experts, num_dies)


def bank_bytes(cfg: ModelConfig, num_dies: int, eplb: EPLBConfig) -> int:
    """App-area bytes of one die's expert bank (2 S buffers per MoE layer)."""
    slots = eplb.physical(cfg, num_dies) // num_dies
    n_moe = cfg.n_layers - cfg.n_dense_layers
    return n_moe * 2 * slots * 3 * cfg.hidden * cfg.moe_inter * 4 + 4096


def move_list(old: ExpertMap, new: ExpertMap, layer: int) -> list[tuple[int, int, int, int]]:
    """The expert moves of one MoE layer from `old` to `new`, the same on every die.

    Returns `(dst die, dst local slot, logical expert, src die)` in ascending (dst, slot): every
    slot whose new expert its die does not hold yet in `old`; the source is one of the dies that
    hold it in `old`, taken in turn (`holders[(dst + slot) % len(holders)]`) to spread the
    sending."""
    d, s = new.num_dies, new.slots_per_die
    before = old.phy2log[layer].reshape(d, s)
    after = new.phy2log[layer].reshape(d, s)
    out = []
    for dst in range(d):
        held = set(before[dst].tolist())
        for slot, e in enumerate(after[dst].tolist()):
            if e in held:
                continue
            holders = np.flatnonzero((before == e).any(axis=1))
            out.append((dst, slot, e, int(holders[(dst + slot) % holders.size])))
    return out


@dataclass
class _Pending:
    seq: int
    map: ExpertMap
    start: int  # the step whose start moves MoE layer 0
    switch: int  # the step whose start switches
    slot_buf: np.ndarray  # [n_moe, S] the bank buffer of each slot after the switch
    moved_bytes: int = 0
    move_ns: int = 0


class ExpertBalancer:
    """One die's side of EPLB (see the module docstring); with `eplb=None` it only records.

    Arguments:
        die: the calling die.
        model: its `DieModel` (built without routed experts when EPLB is on: the bank holds them).
        eplb: the config, or None.
        keep_history: keep every step's per-slot counts (the decode report).
        fill: `fill(layer, logical expert) -> FFNWeights` for the bank's initial contents
            (default: the seed-built expert, `runtime.model.weights.expert_ffn`); tests pass
            value-coded weights.
    """

    def __init__(self, die, model: DieModel, eplb: EPLBConfig | None, keep_history: bool = False,
                 fill=None, members: tuple[int, ...] | None = None,
                 router: bool = False):  # fmt: skip
        cfg = model.cfg
        self.die, self.model, self.cfg, self.eplb = die, model, cfg, eplb
        # the dies that host the experts (a split pod's expert dies; every die colocated), and
        # this die's index among them; a router (a split pod's attention die) only routes
        self.members = tuple(range(die.num_dies)) if members is None else tuple(members)
        self.router = router
        self.n = len(self.members)
        self.me = -1 if router else self.members.index(die.die_id)
        self.leader = self.members[0]
        self.first = cfg.n_dense_layers
        self.n_moe = cfg.n_layers - cfg.n_dense_layers
        self.history: list[np.ndarray] | None = [] if keep_history else None
        self.maps: list[dict] = []  # switches: {"seq", "plan_step", "switch_step", "phy2log"}
        self.moves: list[dict] = []  # this die's moves per plan: bytes received, ns
        self.step = -1
        if eplb is None:
            self.map = ExpertMap.identity(max(self.n_moe, 1), cfg.num_experts, self.n)
            self.slots = cfg.num_experts // self.n
            place = Placement.default(cfg.num_experts, tuple(range(self.n)))
            ids = place.experts_on(self.me).tolist()
            self.local = [ids] * self.n_moe
            self.counts = np.zeros((max(self.n_moe, 1), self.slots), np.int64)
            return
        lo = die.layout
        self.map = initial_map(cfg, self.n, eplb)
        self.slots = self.map.slots_per_die
        if lo.eplb_layers != self.n_moe or lo.a2a_experts_per_die != self.slots:
            raise ConfigError(
                f"eplb: the pod was laid out for {lo.eplb_layers} layers x"
                f" {lo.a2a_experts_per_die} slots, the model needs {self.n_moe} x {self.slots}"
            )
        self.window = lo.eplb_window
        self.w = die.words[die.die_id]
        self.word = {k: lo.eplb_word(v) for k, v in (
            ("plan_seq", L.EP_PLAN_SEQ), ("plan_step", L.EP_PLAN_STEP), ("ready", L.EP_READY),
            ("switched", L.EP_SWITCHED), ("count_step", L.EP_COUNT_STEP),
            ("moved_bytes", L.EP_MOVED_BYTES), ("move_ns", L.EP_MOVE_NS),
            ("balance", L.EP_BALANCE_PPM), ("rows", L.EP_ROWS),
            ("count_by", L.EP_COUNT_BY), ("ready_by", L.EP_READY_BY))}  # fmt: skip
        # Every die polls and reads at home (rule R1, docs/protocols.md §11): the leader pushes
        # the plan into every die's plan area, each die its count_step into the leader's
        # count_by word and its ready into every member's ready_by word.
        self.plans = [self._plan_area(p) for p in range(die.num_dies)]
        self.seq = 0  # plans taken
        self.win_start = 0
        self.plan_at = self._next_plan(0)
        self.pending: _Pending | None = None
        self.counts = np.zeros((self.n_moe, self.slots), np.int64)
        self.maps.append({"seq": 0, "plan_step": -1, "switch_step": 0,
                          "phy2log": self.map.phy2log.tolist()})  # fmt: skip
        if router:  # routes with the map in force; the expert dies hold the bank
            self.slot_buf = np.zeros((self.n_moe, self.slots), np.int64)
            self.local = []
            return
        self.rings = [self._ring(p) for p in self.members]
        self.ring = self.rings[self.me]
        h, inter = cfg.hidden, cfg.moe_inter
        self.pool = die.alloc((self.n_moe, 2 * self.slots, 3, h * inter), np.float32)
        self.slot_buf = np.tile(np.arange(self.slots, dtype=np.int64), (self.n_moe, 1))
        fill = fill or (lambda layer, e: expert_ffn(cfg, layer, e))
        for j in range(self.n_moe):
            for i, e in enumerate(self._local_row(self.map, j)):
                f = fill(self.first + j, e)
                buf = self.pool[j, i]
                buf[0], buf[1], buf[2] = f.w_gate.ravel(), f.w_up.ravel(), f.w_down.ravel()
        self.local: list[list[int]] = []
        self._install()
        self.estimate = np.zeros((self.n_moe, cfg.num_experts), np.float64)  # the leader's

    # -- shared-memory views ------------------------------------------------------------------

    def _ring(self, p: int) -> np.ndarray:
        lo = self.die.layout
        arr = self.die.regions[p].array
        n = lo.eplb_window * lo.eplb_row_words
        view = arr[lo.eplb_counts_off : lo.eplb_counts_off + n * 8].view(np.int64)
        return view.reshape(lo.eplb_window, lo.eplb_row_words)

    def _plan_area(self, p: int) -> np.ndarray:
        lo = self.die.layout
        n = lo.eplb_layers * lo.a2a_num_experts
        view = self.die.regions[p].array[lo.eplb_plan_off : lo.eplb_plan_off + n * 8]
        return view.view(np.int64).reshape(lo.eplb_layers, lo.a2a_num_experts)

    # -- the map in force -----------------------------------------------------------------------

    def _local_row(self, m: ExpertMap, j: int) -> list[int]:
        s = self.slots
        return m.phy2log[j, self.me * s : (self.me + 1) * s].tolist()

    def _ffn(self, j: int, b: int) -> FFNWeights:
        h, inter = self.cfg.hidden, self.cfg.moe_inter
        buf = self.pool[j, b]
        return FFNWeights(buf[0].reshape(h, inter), buf[1].reshape(h, inter),
                          buf[2].reshape(inter, h))  # fmt: skip

    def _install(self) -> None:
        """Point the model's expert tables and the routing at `self.map` / `self.slot_buf`."""
        self.local = [self._local_row(self.map, j) for j in range(self.n_moe)]
        for j, ids in enumerate(self.local):
            table = {e: self._ffn(j, int(self.slot_buf[j, i])) for i, e in enumerate(ids)}
            self.model.weights.experts[self.first + j] = table

    def _next_plan(self, win_start: int) -> int | None:
        limit = self.eplb.num_plans()
        if limit is not None and self.seq >= limit:
            return None
        return win_start + self.eplb.every - 1

    # -- the forward's hooks ---------------------------------------------------------------------

    def route(self, layer: int, topk_idx: np.ndarray) -> np.ndarray:
        """Physical slots for a die's `topk_idx` (logical) of model layer `layer`."""
        if self.eplb is None:
            return topk_idx
        j = layer - self.first
        return replica_for(
            self.map, j, topk_idx, row_positions(topk_idx.shape[0], self.die.die_id, self.step)
        )

    def local_ids(self, layer: int) -> list[int]:
        """Logical expert of each local slot of model layer `layer` (the map in force)."""
        return self.local[layer - self.first]

    def record(self, layer: int, expert_counts: np.ndarray) -> None:
        """Rows each local slot received in `layer` this step (a split pod's expert die
        receives a layer in D x m calls: they add up)."""
        self.counts[layer - self.first] += expert_counts  # with EPLB: the ring row itself

    # -- step boundaries ----------------------------------------------------------------------

    def begin_step(self, b: int) -> None:
        """Before the forward of busy step `b` (0, 1, 2, ... on every die)."""
        self.step = b
        if self.eplb is None:
            self.counts[:] = 0
            return
        if not self.router:
            row = self.ring[b % self.window]
            row[1:] = 0
            row[0] = b
            self.counts = row[1:].reshape(self.n_moe, self.slots)  # `record` writes the ring
        if self.pending is None and self.plan_at is not None and b == self.plan_at + 2:
            self._take_plan(b)
        p = self.pending
        if p is not None and p.start <= b < p.switch and not self.router:
            self._move(b - p.start, p)
        if p is not None and b == p.switch:
            self._switch(p)

    def end_step(self, b: int) -> None:
        """After the forward of busy step `b`."""
        if self.history is not None:
            self.history.append(self.counts.copy())
        if self.eplb is None or self.router:
            return
        self.w[self.word["rows"]] += int(self.counts.sum())
        self.w[self.word["count_step"]] = b + 1  # steps complete
        self.die.fab.publish(self.leader, self.word["count_by"] + self.die.die_id, b + 1)
        if self.me == 0 and b == self.plan_at and self.pending is None:
            self._make_plan(b)

    # -- the leader ------------------------------------------------------------------------------

    def step_counts(self, t: int) -> np.ndarray:
        """int64 `[n_moe, P]`: rows per physical slot in step `t`, from every die's ring in
        shared memory (each die must have finished step `t`, and not be `window` steps past)."""
        n, s = self.n, self.slots
        out = np.empty((self.n_moe, n * s), np.int64)
        fab, lo = self.die.fab, self.die.layout
        for p in range(n):
            row = self.rings[p][t % self.window]
            if fab.remote[self.members[p]]:  # another host's ring row: a pull (rule R4)
                off = lo.eplb_counts_off + (t % self.window) * row.nbytes
                fab.pull(self.members[p], off, row.nbytes)
            if row[0] != t:
                raise ProtocolError(
                    f"eplb: die {p}'s count row {t % self.window} holds step {row[0]},"
                    f" not {t}: the window outgrew the ring"
                )
            out[:, p * s : (p + 1) * s] = row[1:].reshape(self.n_moe, s)
        return out

    def _make_plan(self, b: int) -> None:
        t0 = time.perf_counter_ns()
        for p in self.members:
            self.die.wait_ge(self.w, self.word["count_by"] + p, b + 1, p,
                             "eplb.count_by (its load of the window)")  # fmt: skip
        t1 = time.perf_counter_ns()
        self.die.trace.rec(t0, t1 - t0, TRACE_OP, 3, -1, EPLB_LANE, b, 0)
        phys = np.zeros((self.n_moe, self.n * self.slots), np.int64)
        share = np.zeros((self.n_moe, self.cfg.num_experts), np.float64)
        for t in range(self.win_start, b + 1):
            c = self.step_counts(t)
            phys += c
            frac = c / np.maximum(c.sum(axis=1, keepdims=True), 1)
            for j in range(self.n_moe):
                np.add.at(share[j], self.map.phy2log[j], frac[j])
        self.estimate = self.eplb.decay * self.estimate + share
        load = self.estimate
        per_die = phys.reshape(self.n_moe, self.n, self.slots).sum(-1)
        top = per_die.max(axis=1)
        bal = np.where(top > 0, per_die.mean(axis=1) / np.maximum(top, 1), 1.0)
        self.w[self.word["balance"]] = int(round(float(bal.mean()) * 1e6))
        k = self.seq + 1
        if self.eplb.maps:
            phy2log = np.asarray(self.eplb.maps[k - 1], np.int64)
        else:
            e = self.eplb
            groups, nodes = e.hierarchy(self.cfg, self.n)
            fresh = plan(load, self.n, e.redundant_per_die, e.policy, groups, nodes)
            phy2log = keep_in_place(self.map, fresh.phy2log, e.dies_per_node)
        fab, lo = self.die.fab, self.die.layout
        for d, area in enumerate(self.plans):  # every die's plan area, plan_step, then seq
            area[:] = phy2log
            self.die.words[d][self.word["plan_step"]] = b
            if fab.remote[d]:
                fab.push(d, lo.eplb_plan_off, area.nbytes)
                fab.push_words(d, self.word["plan_step"])
                fab.publish(d, self.word["plan_seq"], k)
            else:
                self.die.words[d][self.word["plan_seq"]] = k  # LAST
        # the plan's slice: event_id = the step, bytes = the window's balancedness x 1e6
        ppm = int(self.w[self.word["balance"]])
        self.die.trace.rec(t1, time.perf_counter_ns() - t1, TRACE_OP, 0, -1, EPLB_LANE, b, ppm)

    # -- every die -------------------------------------------------------------------------------

    def _take_plan(self, b: int) -> None:
        k = self.seq + 1
        lw = self.w  # the leader pushed the plan here (rule R1)
        self.die.wait_ge(lw, self.word["plan_seq"], k, self.leader, f"eplb.plan_seq (plan {k})")
        if lw[self.word["plan_step"]] != b - 2:
            raise ProtocolError(f"die {self.die.die_id}: eplb plan {k} was made at step"
                              f" {lw[self.word['plan_step']]}, expected {b - 2}")  # fmt: skip
        own = self.plans[self.die.die_id].copy()
        new = ExpertMap.from_phy2log(own, self.cfg.num_experts, self.n)
        self.seq = k
        self.pending = _Pending(k, new, b, b + self.n_moe, np.full_like(self.slot_buf, -1))

    def _move(self, j: int, p: _Pending) -> None:
        t0 = time.perf_counter_ns()
        me, cur = self.me, self.slot_buf[j]
        held = {e: int(cur[i]) for i, e in enumerate(self.local[j])}
        after = self._local_row(p.map, j)
        for i, e in enumerate(after):
            if e in held:
                p.slot_buf[j, i] = held[e]
        used = set(cur.tolist())
        free = [b for b in range(2 * self.slots) if b not in used]
        reqs, got = [], 0
        for idx, (dst, slot, e, src) in enumerate(move_list(self.map, p.map, j)):
            ev = EVENT_BASE + ((p.seq * 4096 + j) << 16) + idx
            if dst == me:
                b = free.pop(0)
                p.slot_buf[j, slot] = b
                reqs.append(comm.irecv(self.die, self.pool[j, b], self.members[src], ev,
                                       variant="zero-copy"))  # fmt: skip
                got += self.pool[j, b].nbytes
            elif src == me:
                buf = self.pool[j, held[e]]
                reqs.append(comm.isend(self.die, buf, self.members[dst], ev, variant="zero-copy"))
        for r in reqs:
            r.wait()
        dt = time.perf_counter_ns() - t0
        p.moved_bytes += got
        p.move_ns += dt
        self.w[self.word["moved_bytes"]] += got
        self.w[self.word["move_ns"]] += dt
        self.die.trace.rec(t0, dt, TRACE_OP, 1, self.first + j, EPLB_LANE, self.step, got)
        if j == self.n_moe - 1:
            self.w[self.word["ready"]] = p.seq
            for q in self.members:  # this die's ready in every member's region (rule R1)
                self.die.fab.publish(q, self.word["ready_by"] + self.die.die_id, p.seq)

    def _switch(self, p: _Pending) -> None:
        t0 = time.perf_counter_ns()
        if self.router:  # the expert dies switch at the same step, or the pod fails
            self.map = p.map
        else:
            for q in self.members:
                self.die.wait_ge(self.w, self.word["ready_by"] + q, p.seq, q,
                                 f"eplb.ready_by (its expert moves of plan {p.seq})")  # fmt: skip
            self.map, self.slot_buf = p.map, p.slot_buf
            self._install()
        self.pending = None
        self.win_start = p.switch
        self.plan_at = self._next_plan(p.switch)
        self.w[self.word["switched"]] = p.seq
        self.maps.append({"seq": p.seq, "plan_step": p.start - 2, "switch_step": p.switch,
                          "phy2log": p.map.phy2log.tolist()})  # fmt: skip
        self.moves.append({"seq": p.seq, "bytes": p.moved_bytes, "ns": p.move_ns})
        dt = time.perf_counter_ns() - t0
        self.die.trace.rec(t0, dt, TRACE_OP, 2, -1, EPLB_LANE, self.step, p.seq)

    def report(self) -> dict:
        """What the launcher needs: per-step per-slot counts, the maps switched to, the moves."""
        return {
            "slots": self.slots,
            "counts": [c.tolist() for c in self.history] if self.history is not None else None,
            "maps": self.maps,
            "moves": self.moves,
        }

    def close(self) -> None:
        if self.eplb is not None and not self.router:
            self.die.free(self.pool)
