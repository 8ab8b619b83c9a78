"""`PodConfig`: every knob of a pod in one frozen dataclass.

Built once from defaults, an optional TOML file and CLI flags (`PodConfig.load(toml, **flags)`),
validated in `__post_init__` with messages that name the field, and shipped as a plain dict to every
die. Unknown keys are errors, never silently dropped. Derived numbers (the region layout) come from
`memory.layout.compute(...)` and are never written back here.
"""

from __future__ import annotations

import dataclasses
import os
import tomllib
from dataclasses import dataclass, fields

from comm.quant import COMBINE_DTYPES
from comm.wait import WaitPolicy
from memory import layout as L
from memory.errors import ConfigError

KiB, MiB = 1 << 10, 1 << 20


@dataclass(frozen=True)
class PodConfig:
    """Configuration of one pod.

    Attributes:
        num_dies: dies (OS processes), 1..256.
        cores: CPU cores the pod may use (pinning, wait policy); default: the machine's.
        lanes: AIV lanes per die: the largest `cores=` an operation may ask for.
        ub_bytes: unified buffer per lane (MTE2/MTE3 staging), split in two ping-pong halves.
        ring_slots, slot_bytes: geometry of each (sender, lane) ring in the managed area.
        app_bytes: app area per die (user buffers, zero-copy targets, KV cache).
        max_region_bytes: refuse a layout whose region would be larger than this.
        timeout_s: deadline of every wait (PeerTimeout after it).
        wait: "auto" (spin when num_dies <= cores, else yield every poll), "spin" or "yield".
        pin: "auto" (pin die i to core i % cores when the dies spread evenly over the cores:
            num_dies <= cores or a multiple of cores), "on" or "off".
        trace: record every protocol step in every die from the start.
        trace_capacity: records kept per die (oldest dropped).
        start_method: how die processes start: "fork" (fast) or "spawn".
        ready_timeout_s: how long launch waits for every die to report ready.
        a2a_max_batch: tokens per die of an expert-parallel all-to-all (0: no all-to-all areas).
        a2a_hidden, a2a_topk, num_experts: its hidden size, experts per token and expert count
            (num_experts must divide over the dies).
        a2a_max_local_experts: the most experts one die may host (sizes the combine areas);
            0 = num_experts // num_dies, the default placement. Raise it for load-balancing
            placements that put more experts on one die.
        a2a_dispatch_dtype: "float32" (dispatch rows hold float32 payloads, so both quant=None
            and quant="int8" work) or "int8" (rows of `hidden` bytes + 16 B of metadata, the
            paper's buffer formula, a quarter of the memory; quant=None is then refused).
        a2a_combine_dtype: "bfloat16" (combine rows travel in 16 bits, as the paper sends them,
            000 §4.2.1: each expert output row is rounded to nearest even once, the token's die
            sums them in float32) or "float32" (rows travel unrounded, twice the bytes).
        serve_slot_bytes: bytes of each slot of the serving command and result rings in every
            die's region (0: a pod that does not serve; `runtime.engine.Engine` sets it).
        eplb_layers, eplb_window: expert load balancing (`runtime.model.expert_balancer`): the
            MoE layers whose per-slot load each die records, and the steps its count ring keeps
            (0: off; the decode and serving launchers set them).
        die_cpus: a core per die (a PD pod's parts on their own cores); empty: `pin` decides.
        hosts: the host of every die (`--hosts 2,2` -> (0, 0, 1, 1)); empty: one host.
        fabric: how dies reach the regions of other hosts' dies (`comm.fabric`): "auto" (MPI
            RMA when `hosts` names more than one host), "mpi" (MPI: two-sided store messages
            for pushes and guards, one-sided pulls and atomics), "mpi-rma" (MPI one-sided
            only: Put, Flush, Accumulate per guard), or "mirror" (hosts emulated
            over shared memory with poisoned mirrors and no MPI: a test of the protocols'
            push / pull / publish discipline).
        host_names: the names of `hosts`' hosts for mpirun (`--hosts nodeA:8,nodeB:8`);
            empty: every host is this machine (emulated hosts).
        net_if: the interface (or CIDR) MPI's TCP transport and the control plane use between
            hosts (`btl_tcp_if_include`); default "lo" for emulated hosts.
        capture: a capture pod (docs/projection.md): every die records every event projected
            time needs (`comm.capture`), every peer reached through the fabric seam; one host.
    """

    num_dies: int = 4
    cores: int = 0
    lanes: int = 4
    ub_bytes: int = 192 * KiB
    ring_slots: int = 8
    slot_bytes: int = 96 * KiB
    app_bytes: int = 32 * MiB
    max_region_bytes: int = 4096 * MiB
    timeout_s: float = 30.0
    wait: str = "auto"
    pin: str = "auto"
    trace: bool = False
    trace_capacity: int = 1 << 16
    start_method: str = "fork"
    ready_timeout_s: float = 60.0
    a2a_max_batch: int = 0
    a2a_hidden: int = 0
    a2a_topk: int = 0
    num_experts: int = 0
    a2a_max_local_experts: int = 0
    a2a_dispatch_dtype: str = "float32"
    a2a_combine_dtype: str = "bfloat16"
    serve_slot_bytes: int = 0
    eplb_layers: int = 0
    eplb_window: int = 0
    die_cpus: tuple = ()
    hosts: tuple = ()
    fabric: str = "auto"
    host_names: tuple = ()
    net_if: str = ""
    capture: bool = False

    def __post_init__(self) -> None:
        if self.cores == 0:
            object.__setattr__(self, "cores", len(os.sched_getaffinity(0)))
        _int_in("num_dies", self.num_dies, 1, 256)
        _int_in("cores", self.cores, 1, 4096)
        _int_in("lanes", self.lanes, 1, 64)
        _int_in("ub_bytes", self.ub_bytes, 128, 64 * MiB)
        if self.ub_bytes % 128:
            raise ConfigError(f"ub_bytes: {self.ub_bytes} must be a multiple of 128")
        _int_in("ring_slots", self.ring_slots, 2, 1 << 16)
        _int_in("slot_bytes", self.slot_bytes, 64, 1 << 30)
        if self.slot_bytes % 64:
            raise ConfigError(f"slot_bytes: {self.slot_bytes} must be a multiple of 64")
        _int_in("app_bytes", self.app_bytes, 0, 1 << 40)
        _int_in("max_region_bytes", self.max_region_bytes, L.PAGE, 1 << 42)
        _int_in("trace_capacity", self.trace_capacity, 16, 1 << 26)
        if not isinstance(self.timeout_s, int | float) or not 0 < self.timeout_s <= 86400:
            raise ConfigError(f"timeout_s: {self.timeout_s!r} must be in (0, 86400] seconds")
        if not isinstance(self.ready_timeout_s, int | float) or self.ready_timeout_s <= 0:
            raise ConfigError(f"ready_timeout_s: {self.ready_timeout_s!r} must be > 0 seconds")
        _choice("wait", self.wait, ("auto", "spin", "yield"))
        _choice("pin", self.pin, ("auto", "on", "off"))
        _choice("start_method", self.start_method, ("fork", "spawn"))
        if not isinstance(self.trace, bool):
            raise ConfigError(f"trace: {self.trace!r} must be true or false")
        _int_in("a2a_max_batch", self.a2a_max_batch, 0, 1 << 20)
        _choice("a2a_dispatch_dtype", self.a2a_dispatch_dtype, ("float32", "int8"))
        _choice("a2a_combine_dtype", self.a2a_combine_dtype, COMBINE_DTYPES)
        _int_in("serve_slot_bytes", self.serve_slot_bytes, 0, 1 << 30)
        _int_in("eplb_layers", self.eplb_layers, 0, 1 << 12)
        _int_in("eplb_window", self.eplb_window, 0, 1 << 16)
        object.__setattr__(self, "die_cpus", tuple(self.die_cpus))
        if self.die_cpus and (
            len(self.die_cpus) != self.num_dies
            or not all(isinstance(c, int) and c >= 0 for c in self.die_cpus)
        ):
            raise ConfigError(f"die_cpus: {list(self.die_cpus)!r} must give each of the"
                              f" {self.num_dies} dies a core index >= 0")  # fmt: skip
        self._check_hosts()
        if self.eplb_layers and not (self.a2a_max_batch and self.eplb_window):
            raise ConfigError(
                "eplb_layers: expert load balancing needs a2a_max_batch and eplb_window"
            )
        if self.serve_slot_bytes % 64:
            raise ConfigError(f"serve_slot_bytes: {self.serve_slot_bytes} must be a multiple of 64")
        if self.a2a_max_batch:
            _int_in("a2a_hidden", self.a2a_hidden, 1, 1 << 20)
            _int_in("num_experts", self.num_experts, 1, 1 << 20)
            _int_in("a2a_topk", self.a2a_topk, 1, self.num_experts)
            _int_in("a2a_max_local_experts", self.a2a_max_local_experts, 0, self.num_experts)
            if self.num_experts % self.num_dies and not self.a2a_max_local_experts:
                raise ConfigError(
                    f"num_experts: {self.num_experts} experts do not divide over"
                    f" {self.num_dies} dies (set a2a_max_local_experts for another placement,"
                    " e.g. experts on the expert dies of an A2E pod)"
                )
        lo = self.layout()
        if lo.region_bytes > self.max_region_bytes:
            raise ConfigError(
                f"app_bytes/ring_slots/slot_bytes: one region needs {lo.region_bytes} B"
                f" ({lo.region_bytes / MiB:.1f} MiB: app {lo.app_bytes}, rings"
                f" {lo.managed_bytes}), more than max_region_bytes {self.max_region_bytes}"
            )

    def _check_hosts(self) -> None:
        object.__setattr__(self, "hosts", tuple(self.hosts))
        object.__setattr__(self, "host_names", tuple(self.host_names))
        _choice("fabric", self.fabric, ("auto", "mpi", "mpi-rma", "mirror"))
        hosts = self.hosts
        if hosts:
            if len(hosts) != self.num_dies or not all(
                isinstance(h, int) and not isinstance(h, bool) and h >= 0 for h in hosts
            ):
                raise ConfigError(
                    f"hosts: {list(hosts)!r} must give each of the {self.num_dies} dies a host"
                    " index >= 0"
                )
            if list(hosts) != sorted(hosts) or sorted(set(hosts)) != list(range(hosts[-1] + 1)):
                raise ConfigError(
                    f"hosts: {list(hosts)!r}: hosts hold consecutive dies, numbered 0, 1, ..."
                )
        if self.host_names and len(self.host_names) != self.num_hosts:
            raise ConfigError(
                f"host_names: {list(self.host_names)!r} names {len(self.host_names)} hosts,"
                f" hosts has {self.num_hosts}"
            )
        if not isinstance(self.net_if, str):
            raise ConfigError(f"net_if: {self.net_if!r} must be an interface name or CIDR")
        if not isinstance(self.capture, bool):
            raise ConfigError(f"capture: {self.capture!r} must be True or False")
        if self.capture and self.num_hosts > 1:
            raise ConfigError("capture: a capture pod runs on one host (hosts names several)")

    @property
    def num_hosts(self) -> int:
        return self.hosts[-1] + 1 if self.hosts else 1

    @property
    def fabric_kind(self) -> str:
        """ "local" (one host), "capture", "mirror" or "mpi"."""
        if self.capture:
            return "capture"
        if self.num_hosts == 1 and self.fabric not in ("mpi", "mpi-rma"):
            return "local"
        return "mirror" if self.fabric == "mirror" else "mpi"

    # -- derived --------------------------------------------------------------------------------

    def layout(self) -> L.RegionLayout:
        return L.compute(
            num_dies=self.num_dies,
            lanes=self.lanes,
            ring_slots=self.ring_slots,
            slot_bytes=self.slot_bytes,
            app_bytes=self.app_bytes,
            a2a_max_batch=self.a2a_max_batch,
            a2a_hidden=self.a2a_hidden,
            a2a_topk=self.a2a_topk,
            a2a_experts_per_die=(self.a2a_max_local_experts or self.num_experts // self.num_dies)
            if self.a2a_max_batch
            else 0,
            a2a_num_experts=self.num_experts if self.a2a_max_batch else 0,
            a2a_dispatch_bytes=1 if self.a2a_dispatch_dtype == "int8" else 4,
            a2a_combine_bytes=2 if self.a2a_combine_dtype == "bfloat16" else 4,
            serve_slot_bytes=self.serve_slot_bytes,
            eplb_layers=self.eplb_layers if self.a2a_max_batch else 0,
            eplb_window=self.eplb_window if self.a2a_max_batch else 0,
        )

    def wait_policy(self) -> WaitPolicy:
        if self.wait == "spin":
            return WaitPolicy(spin_polls=20000, yield_every=64, timeout_s=self.timeout_s)
        if self.wait == "yield":
            return WaitPolicy(spin_polls=0, yield_every=1, timeout_s=self.timeout_s)
        return WaitPolicy.for_pod(self.num_dies, self.cores, self.timeout_s)

    def pinned(self) -> bool:
        """Whether die i is pinned to core i % cores. With more dies than cores, "auto" pins
        when they spread evenly: dies that wait by yielding are always runnable, so the kernel
        cannot tell them from working ones and may leave 3 of 4 dies on one core and the
        fourth spinning alone on the other (measured, `xpod decode --dies 4` in alternating
        pairs with a one-process baseline: median pair 0.93-1.06x unpinned, 1.14-1.18x
        pinned); an uneven split (3 dies on 2 cores) is better left to the scheduler."""
        if self.pin == "on":
            return True
        return self.pin == "auto" and (
            self.num_dies <= self.cores or self.num_dies % self.cores == 0
        )

    # -- construction ---------------------------------------------------------------------------

    def replace(self, **changes: object) -> PodConfig:
        _check_keys(changes)
        return dataclasses.replace(self, **changes)

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> PodConfig:
        _check_keys(d)
        return cls(**d)

    @classmethod
    def load(cls, toml_path: str | None = None, **overrides: object) -> PodConfig:
        """Defaults, then the TOML file's keys (top level or under [pod]), then `overrides`.

        Overrides whose value is None are ignored (unset CLI flags).
        """
        values: dict = {}
        if toml_path:
            try:
                with open(toml_path, "rb") as f:
                    doc = tomllib.load(f)
            except (OSError, tomllib.TOMLDecodeError) as e:
                raise ConfigError(f"config file {toml_path}: {e}") from e
            values.update(doc.get("pod", doc))
        values.update({k: v for k, v in overrides.items() if v is not None})
        _check_keys(values)
        return cls(**values)


def _check_keys(d: dict) -> None:
    known = {f.name for f in fields(PodConfig)}
    unknown = sorted(set(d) - known)
    if unknown:
        raise ConfigError(
            f"unknown PodConfig field(s) {', '.join(unknown)}; known: {sorted(known)}"
        )


def _int_in(name: str, v: object, lo: int, hi: int) -> None:
    if not isinstance(v, int) or isinstance(v, bool) or not lo <= v <= hi:
        raise ConfigError(f"{name}: {v!r} must be an integer in [{lo}, {hi}]")


def _choice(name: str, v: object, allowed: tuple[str, ...]) -> None:
    if v not in allowed:
        raise ConfigError(f"{name}: {v!r} must be one of {', '.join(allowed)}")
