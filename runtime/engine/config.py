"""`EngineConfig`: every knob of a serving engine, checked once, and the pod it needs."""

from __future__ import annotations

import math
import os
from dataclasses import dataclass, field

from comm.alltoall import Split
from comm.quant import COMBINE_DTYPES
from memory import layout as L
from memory.errors import ConfigError
from runtime.engine.pd import POLICIES, PDTopology
from runtime.engine.pool_config import PoolConfig
from runtime.model import EPLBConfig, ModelConfig, pod_config_for
from runtime.model.mtp import SpecConfig
from runtime.pod import PodConfig
from sched.lb import POLICIES as LB_POLICIES


@dataclass(frozen=True)
class EngineConfig:
    """Every knob of an engine (validated at construction).

    Attributes:
        dies: DP groups = dies (TP = 1); on a split pod, the attention dies.
        expert_dies: 0 = colocated (every die attends and hosts experts); E > 0 = a split pod
            (MoE-attention disaggregation, 001 §5.2): `dies` attention dies (the DP groups,
            dies 0..dies-1) and E expert dies running one persistent loop.
        domains, microbatches: a split pod's DP domains (the attention dies in D groups taking
            turns on the expert dies) and micro-batches per domain and layer (1 or 2).
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
        lb_policy: "least_kv", "round_robin" or "prefix" (`sched.lb`: KV-centric, a baseline
            for the KV pool's load-only routing).
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
        recover: a die, master or output process that dies or hangs is restarted with every
            accepted request kept and resumed from its delivered tokens
            (`runtime.engine.supervisor`); False: the engine fails and every request ends
            with an error (the behaviour before recovery existed).
        stall_timeout_s: no die's progress word changes this long while requests run = hang.
        heartbeat_timeout_s: a group silent to the heartbeat this long = hang.
        max_restarts, restart_window_s: more restarts than this in the window give up (every
            request ends with an error, the engine is down).
        rollback: a transient link fault (a collective's link error, a lost write past
            `op_timeout_s`) rolls the step back and runs it again on every die, no process
            restarted (001 §6.3 Stage 1; `runtime.engine.executor`); three rollbacks of one
            step escalate to a restart. False (or with `eplb`, whose expert moves span
            steps): such a fault is a restart (or, without `recover`, the end).
        op_timeout_s: deadline of a step's collective waits while serving (well below
            `timeout_s`: a lost write is seen after it).
        inject: a fault plan (`runtime.engine.faults`), "" = none.
        fault_log: a file: every injection, detection and recovery as a JSON line.
        prefill_dies, decode_dies: > 0: a PD pod (prefill-decode disaggregation,
            `runtime.engine.pd`): dies 0..P-1 prefill, P..P+D-1 decode, each part its own
            lockstep EP group (`dies` becomes P + D; the experts split over each part).
        decode_blocks: a decode die's KV blocks (0: num_blocks; backpressure experiments).
        kv_policy: a PD request whose KV transfer failed: "recompute" (the shell sends it
            again) or "fail" (it ends with an error event).
        kv_lease_s: a prefill die frees a request's blocks this long after its prefill if the
            decode side has not read them (vLLM NIXL's kv_lease_duration).
        kv_timeout_s: a decode master probes the link of a request waiting this long for its
            KV; no echo within it more = the link is dead (the request fails).
        kv_checksum: the prefill die sends the crc32 of every transfer's source and the decode
            master checks what landed (timed apart from the copy; False: no check).
        speculative: MTP speculative decoding (`runtime.model.mtp.SpecConfig`: k drafts per
            decode row from the model's MTP module, which it adds), or None. Plans
            synchronously (`async_depth` becomes 1: every plan sees exact positions).
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
    recover: bool = True
    rollback: bool = True
    op_timeout_s: float = 0.5
    stall_timeout_s: float = 1.0
    heartbeat_timeout_s: float = 1.5
    max_restarts: int = 3
    restart_window_s: float = 60.0
    inject: str = ""
    fault_log: str = ""
    expert_dies: int = 0
    domains: int = 1
    microbatches: int = 1
    prefill_dies: int = 0
    decode_dies: int = 0
    decode_blocks: int = 0
    kv_policy: str = "recompute"
    kv_lease_s: float = 30.0
    kv_timeout_s: float = 2.0
    kv_checksum: bool = True
    speculative: SpecConfig | None = None
    kv_pool: PoolConfig | None = None  # the pod-wide KV pool (runtime.engine.pool_shell)
    hosts: tuple = ()  # pods over hosts (PodConfig.hosts / fabric / host_names / net_if)
    fabric: str = "auto"
    host_names: tuple = ()
    net_if: str = ""

    def __post_init__(self) -> None:
        self._check_spec()
        if self.kv_pool is not None:
            if not isinstance(self.kv_pool, PoolConfig):
                raise ConfigError(f"kv_pool: expected a PoolConfig or None, got {self.kv_pool!r}")
            if not self.prefix_cache:
                raise ConfigError("kv_pool: needs the prefix cache (loaded blocks join it)")
        m = self.model_config()
        if self.prefill_dies or self.decode_dies:
            self._check_pd(m)
        if (
            isinstance(self.expert_dies, bool)
            or not isinstance(self.expert_dies, int)
            or (self.expert_dies < 0)
        ):
            raise ConfigError(f"expert_dies: {self.expert_dies!r} must be an int >= 0")
        if self.pd is None:
            m.validate(self.pod_dies, self.expert_dies or None)
        if self.expert_dies:
            self.split  # noqa: B018 - checked here (ConfigError)
            if self.dies > L.MAX_PARKED:
                raise ConfigError(f"dies: a split serving pod has at most {L.MAX_PARKED}"
                                  " attention dies")  # fmt: skip
        elif self.domains != 1 or self.microbatches != 1:
            raise ConfigError("domains / microbatches: need a split pod (expert_dies > 0)")
        if self.eplb is not None:
            if not isinstance(self.eplb, EPLBConfig):
                raise ConfigError(f"eplb: expected an EPLBConfig or None, got {self.eplb!r}")
            self.eplb.check(m, self.expert_dies or self.dies)
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
        for name in ("stall_timeout_s", "heartbeat_timeout_s", "restart_window_s",
                     "op_timeout_s"):  # fmt: skip
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int | float) or not 0.05 <= v <= 3600:
                raise ConfigError(f"{name}: {v!r} must be a number of seconds in [0.05, 3600]")
        if (
            isinstance(self.max_restarts, bool)
            or not isinstance(self.max_restarts, int)
            or (self.max_restarts < 1)
        ):
            raise ConfigError(f"max_restarts: {self.max_restarts!r} must be an int >= 1")
        if self.inject:
            from runtime.engine.faults import FaultSpecError, parse_faults

            try:
                parse_faults(self.inject, self.dies, self.output_procs, self.pod_dies,
                             self.pool_servers)  # fmt: skip
            except FaultSpecError as e:
                raise ConfigError(f"inject: {e}") from None
        if self.combine_dtype not in COMBINE_DTYPES:
            raise ConfigError(f"combine_dtype: {self.combine_dtype!r} must be bfloat16 or float32")
        if self.async_depth not in (1, 2):
            raise ConfigError(f"async_depth: {self.async_depth!r} must be 1 or 2")
        if self.lb_policy not in LB_POLICIES:
            raise ConfigError(f"lb_policy: {self.lb_policy!r} must be one of"
                              f" {', '.join(LB_POLICIES)}")  # fmt: skip
        if self.pin not in ("auto", "on", "off"):
            raise ConfigError(f"pin: {self.pin!r} must be auto, on or off")
        if self.num_blocks and self.num_blocks < self.blocks_per_seq:
            raise ConfigError(
                f"num_blocks: {self.num_blocks} blocks cannot hold one full context"
                f" ({self.blocks_per_seq} blocks of {self.block_size} tokens)"
            )

    def _check_spec(self) -> None:
        spec = self.speculative
        if spec is None:
            return
        if not isinstance(spec, SpecConfig):
            raise ConfigError(f"speculative: a SpecConfig or None, got {spec!r}")
        if spec.k == 0:
            object.__setattr__(self, "speculative", None)
            return
        if self.eplb is not None:
            raise ConfigError("speculative: MTP runs without EPLB (its layer keeps the default"
                              " placement; not built together)")  # fmt: skip
        object.__setattr__(self, "async_depth", 1)  # MTP plans synchronously

    def _check_pd(self, m: ModelConfig) -> None:
        topo = PDTopology.make(self.prefill_dies, self.decode_dies)
        object.__setattr__(self, "dies", topo.num_dies)
        if self.expert_dies or self.eplb is not None:
            raise ConfigError("prefill_dies / decode_dies: a PD pod has no expert dies and no"
                              " EPLB (not built together)")  # fmt: skip
        object.__setattr__(self, "rollback", False)  # the parts' steps differ: restart instead
        m.validate(self.prefill_dies)
        m.validate(self.decode_dies)
        if self.kv_policy not in POLICIES:
            raise ConfigError(f"kv_policy: {self.kv_policy!r} must be one of {', '.join(POLICIES)}")
        for name in ("kv_lease_s", "kv_timeout_s"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int | float) or not 0.05 <= v <= 3600:
                raise ConfigError(f"{name}: {v!r} must be a number of seconds in [0.05, 3600]")
        b = self.decode_blocks
        if isinstance(b, bool) or not isinstance(b, int) or b < 0:
            raise ConfigError(f"decode_blocks: {b!r} must be an int >= 0")
        if b and b < self.blocks_per_seq:
            raise ConfigError(
                f"decode_blocks: {b} blocks cannot hold one full context"
                f" ({self.blocks_per_seq} blocks of {self.block_size})"
            )

    @property
    def pd(self) -> PDTopology | None:
        """A PD pod's topology (prefill dies first), or None."""
        if not (self.prefill_dies or self.decode_dies):
            return None
        return PDTopology.make(self.prefill_dies, self.decode_dies)

    def model_config(self) -> ModelConfig:
        over = dict(self.model_overrides)
        if self.speculative is not None and self.speculative.k:  # the model's MTP module
            over.update(mtp_layers=1, mtp_fit=self.speculative.draft == "fit")
        return ModelConfig.preset(self.model, **over)

    @property
    def pod_dies(self) -> int:
        """Dies of the pod: the DP groups, plus the expert dies of a split pod."""
        return self.dies + self.expert_dies

    @property
    def pool_servers(self) -> int:
        """KV pool servers (a fault plan's `pool=N` targets): with `kv_pool`, one per host
        with DP groups (one host: one), else none."""
        if self.kv_pool is None:
            return 0
        return len(set(self.hosts[: self.dies])) if self.hosts else 1

    @property
    def split(self) -> Split | None:
        """The split pod's topology (attention dies 0..dies-1), or None when colocated."""
        if not self.expert_dies:
            return None
        return Split.make(self.pod_dies, self.dies, self.domains, self.microbatches)

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
            self.pod_dies,
            max_rows=self.max_num_batched_tokens,
            num_blocks=max(self.blocks, self.decode_blocks),
            block_size=self.block_size,
            quant=self.quant,
            combine_dtype=self.combine_dtype,
            eplb=self.eplb,
            headroom_bytes=4 << 20,
            trace=bool(self.trace),
            serve_slot_bytes=self.slot_bytes(m),
            timeout_s=self.timeout_s,
            pin=self.pin,
            expert_dies=self.expert_dies or None,
            hosts=tuple(self.hosts),
            fabric=self.fabric,
            host_names=tuple(self.host_names),
            net_if=self.net_if,
            **self._pd_pod(m),
        )

    def _pd_pod(self, m: ModelConfig) -> dict:
        """A PD pod's layout: the experts split over each part (the smaller hosts the most),
        prefill dies on core 0 and decode dies on core 1 when pinned (`die_cpus`)."""
        if self.pd is None:
            return {}
        out = {"a2a_max_local_experts": m.num_experts // min(self.prefill_dies,
                                                               self.decode_dies)}  # fmt: skip
        if self.pin != "off" and len(os.sched_getaffinity(0)) >= 2:
            out["die_cpus"] = tuple(0 if d < self.prefill_dies else 1 for d in range(self.dies))
        return out

    def slot_bytes(self, m: ModelConfig) -> int:
        """A step frame's upper bound: every row's block table and tokens; a result's: sampled
        tokens and, when kept, their logits."""
        rows = self.max_num_seqs
        k = self.speculative.k if self.speculative is not None else 0
        step = rows * (self.blocks_per_seq * 5 + 96) + self.max_num_batched_tokens * 5
        if k and self.speculative.transcript:  # an oracle / synthetic transcript per prefill row
            step += rows * m.max_seq_len * 5
        result = rows * (32 + 40 * k) + (rows * (1 + k) * m.vocab_size * 4
                                         if self.keep_logits else 0)  # fmt: skip
        need = max(step, result) + 4096
        return max(64 << 10, -(-need // 4096) * 4096)
