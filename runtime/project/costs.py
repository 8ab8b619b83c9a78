"""What each event costs in projected time (docs/projection.md §2 item 4), all in µs.

An event's cost is a tuple `(cost, lat, xfer)`:
- `cost`: time on its stream's engine once it may start (an `acq`: the poll after its words
  arrived; a `pub`: writing its words);
- `lat`: a `pub`'s flag latency: its words arrive `lat` after it ends;
- `xfer`: for a transfer over the ports, `(req, src, dst, port_us, xfer_us, lat, eng, nbytes)`:
  it asks for the ports `req` after it may start (a get's read latency, a DMA's startup), holds
  the `src` die's egress and the `dst` die's ingress for `port_us` (its bytes at the port's
  rate), ends `xfer_us` after it got them (its bytes at min(port, cores x b_core)), its bytes
  arrive `lat` after it ends, and its engine works `eng` meanwhile (a put: the stream goes on
  when both are done).

Streams (by name): `p2p.tx.*` / `p2p.rx.*` and any other name: 1 core; `a2a*`:
`collective.cores`; `dma*`: the DMA engine (`dma.gbps`, `dma.startup_us`); `s0` / `s1`, the two
decode streams of a micro-batched step (000 §4.2.3): `runtime.stream0_aiv` / `stream1_aiv`
vector cores and their share of the die's cube cores, `runtime.stream<i>_aic / die.aic_cores`
(`op`). A put or get to the die itself is a local copy (no port, no latency). Constants are read
from the profile when an event first needs one, so a capture is refused only for a constant it
needs.
"""

from __future__ import annotations

from typing import NamedTuple

from runtime.project.capture_io import KINDS
from runtime.project.errors import ProjectError
from runtime.project.profile import SCHEMA, Profile

COLLECTIVE_CALLS = frozenset({"dispatch", "combine", "a2e", "e2a"})
P2P_CALLS = frozenset({"send", "recv", "isend", "irecv"})
OP_UNITS = ("aiv", "aic")
OP_DTYPES = ("bf16", "int8")

Cost = tuple[float, float, tuple | None]
ZERO: Cost = (0.0, 0.0, None)


class StreamClass(NamedTuple):
    """How a stream's events are charged: its vector cores, or the DMA engine; a decode
    stream (`DECODE_STREAMS`) computes on `aic`, its share of the die's cube cores, and its
    vector ops move bytes no faster than its `cores` do (`core_bound`)."""

    cores: float
    dma: bool
    aic: float = 1.0
    core_bound: bool = False


# the decode streams of a micro-batched step (000 §4.2.3): name -> the profile's key prefix
DECODE_STREAMS = {"s0": "runtime.stream0", "s1": "runtime.stream1"}


class ProfileCosts:
    """Costs on a hardware profile (every constant from it; a missing one refuses).

    `by_kind[kind](die, stream_class, event, prev_t1)` is an event's Cost (`prev_t1`: the host
    end of the die's previous event in its file; only the host profile reads it). Transfers
    and flags are memoized by what their cost depends on (sizes, stream class, same node or
    not), so a million events cost a dict lookup each, not a dozen constant look-ups.
    """

    serial = False  # a die's streams run side by side (HostCosts: one after another)

    def __init__(self, profile: Profile):
        self.profile = profile
        self._k: dict[str, float] = {}
        self._memo: dict[tuple, tuple] = {}
        self._per_node = 0
        self.nodes: list[int] | None = None  # the capture's placement of dies on nodes
        self.by_kind = {"put": self.put, "get": self.get, "pub": self.pub, "acq": self.acq,
                        "op": self.op, "copy": self.copy, "begin": self.begin, "end": self.zero,
                        "after": self.zero}  # fmt: skip

    def k(self, key: str) -> float:
        """Constant `key` of the profile (ProjectError if it lacks it or marks it unknown)."""
        v = self._k.get(key)
        if v is None:
            v = self._k[key] = self.profile.get(key)
        return v

    def stream_class(self, name: str) -> StreamClass:
        """How stream `name` is charged (module docstring: by its name)."""
        if name.startswith("a2a"):
            return StreamClass(self.k("collective.cores"), False)
        if name.startswith("dma"):
            return StreamClass(1.0, True)
        key = DECODE_STREAMS.get(name)
        if key is not None:
            aic, aiv = self.k(f"{key}_aic"), self.k(f"{key}_aiv")
            if aic > self.k("die.aic_cores") or aiv > self.k("die.aiv_cores"):
                raise ProjectError(f"{key}_aic / _aiv ({aic:g} / {aiv:g}): more cores than the"
                                   f" die has (die.aic_cores / aiv_cores)")  # fmt: skip
            return StreamClass(aiv, False, aic / self.k("die.aic_cores"), True)
        return StreamClass(1.0, False)  # p2p.tx.* / p2p.rx.* lanes and every other stream

    # -- latencies and rates ----------------------------------------------------------------------

    def same_node(self, a: int, b: int) -> bool:
        """Whether dies a and b share a node: the capture's `nodes` (meta.json: a node per
        die, a placement the workload states), else die // die.dies_per_node."""
        if self.nodes is not None:
            return self.nodes[a] == self.nodes[b]
        if not self._per_node:
            self._per_node = int(self.k("die.dies_per_node"))
        return a // self._per_node == b // self._per_node

    def write_latency(self, intra: bool) -> float:
        """A remote write's latency, after its transfer (µs)."""
        return self.k("link.write_latency_intra_us" if intra else "link.write_latency_us")

    def read_latency(self, intra: bool) -> float:
        """A remote read's latency, before its transfer (µs)."""
        return self.k("link.read_latency_intra_us" if intra else "link.read_latency_us")

    def rate(self, sc: StreamClass) -> float:
        """GB/s a stream moves bytes at, before the port's limit."""
        return self.k("dma.gbps") if sc.dma else sc.cores * self.k("aiv.b_core_gbps")

    # -- events -----------------------------------------------------------------------------------

    def put(self, die: int, sc: StreamClass, ev: list, prev_t1: int | None = None) -> Cost:
        """A put: engine work and a transfer on the ports (a local copy if peer == die)."""
        peer, nbytes = ev[4], ev[5]
        local = peer == die
        key = ("put", sc, nbytes, ev[7], ev[8], local or self.same_node(die, peer), local)
        hit = self._memo.get(key)
        if hit is None:
            hit = self._memo[key] = self._put(sc, nbytes, ev[7], ev[8], key[5], local)
        if local:
            return hit
        req, port_us, xfer_us, lat, eng = hit
        return (0.0, 0.0, (req, die, peer, port_us, xfer_us, lat, eng, nbytes))

    def _put(self, sc: StreamClass, nbytes: int, rows: int, tokens: int, intra: bool,
             local: bool) -> tuple:  # fmt: skip
        if sc.dma:  # the DMA engine moves the bytes: the lane waits for the transfer
            eng, req = 0.0, self.k("dma.startup_us")
            rate = self.rate(sc)
        else:  # the stream's cores: the per-row and per-token work, then moving the bytes
            rate = self.rate(sc)
            work = (rows * self.k("aiv.t_row_us") if rows else 0.0) + (
                tokens * self.k("aiv.t_tok_us") if tokens else 0.0
            )
            eng, req = work / sc.cores + self.k("aiv.t_put_us") + nbytes / (rate * 1e3), 0.0
        if local:  # a copy within the die: no port, no latency
            return (req + (eng if not sc.dma else nbytes / (rate * 1e3)), 0.0, None)
        port = self.k("link.port_gbps")
        xfer_us = nbytes / ((min(port, rate) if sc.dma else port) * 1e3)
        return (req, nbytes / (port * 1e3), xfer_us, self.write_latency(intra), eng)

    def get(self, die: int, sc: StreamClass, ev: list, prev_t1: int | None = None) -> Cost:
        """A get: the read latency, then a transfer from the peer's egress into this die."""
        peer, nbytes = ev[4], ev[5]
        local = peer == die
        key = ("get", sc, nbytes, local or self.same_node(die, peer), local)
        hit = self._memo.get(key)
        if hit is None:
            hit = self._memo[key] = self._get(sc, nbytes, key[3], local)
        if local:
            return hit
        req, port_us, xfer_us = hit
        return (0.0, 0.0, (req, peer, die, port_us, xfer_us, 0.0, 0.0, nbytes))

    def _get(self, sc: StreamClass, nbytes: int, intra: bool, local: bool) -> tuple:
        req = self.k("dma.startup_us") if sc.dma else 0.0
        rate = self.rate(sc)
        if local:
            return (req + nbytes / (rate * 1e3), 0.0, None)
        port = self.k("link.port_gbps")
        req += self.read_latency(intra)
        return (req, nbytes / (port * 1e3), nbytes / (min(port, rate) * 1e3))

    def pub(self, die: int, sc: StreamClass, ev: list, prev_t1: int | None = None) -> Cost:
        """A pub: its words' writes on the engine; they arrive the write latency later."""
        peer = ev[4]
        local = peer == die
        key = ("pub", sc, len(ev[5]), local or self.same_node(die, peer), local)
        hit = self._memo.get(key)
        if hit is None:
            lat = 0.0 if local else self.write_latency(key[3])
            hit = self._memo[key] = (key[2] * self.k("aiv.t_flag_us") / sc.cores, lat, None)
        return hit

    def acq(self, die: int, sc: StreamClass, ev: list, prev_t1: int | None = None) -> Cost:
        """An acq: the poll once its words arrived (the wait itself is the graph's)."""
        return (self.k("aiv.t_poll_us"), 0.0, None)

    def copy(self, die: int, sc: StreamClass, ev: list, prev_t1: int | None = None) -> Cost:
        """A copy within the die at the stream's rate (the DMA engine's on a dma stream)."""
        req = self.k("dma.startup_us") if sc.dma else 0.0
        return (req + ev[4] / (self.rate(sc) * 1e3), 0.0, None)

    def begin(self, die: int, sc: StreamClass, ev: list, prev_t1: int | None = None) -> Cost:
        """A call's launch: collective.t_fixed_us or p2p.t_fixed_us by its name, else 0."""
        name = ev[4]
        if name in COLLECTIVE_CALLS:
            return (self.k("collective.t_fixed_us"), 0.0, None)
        if name in P2P_CALLS:
            return (self.k("p2p.t_fixed_us"), 0.0, None)
        return ZERO

    def zero(self, die: int, sc: StreamClass, ev: list, prev_t1: int | None = None) -> Cost:
        """`end` and `after`: no cost of their own (their waits are edges)."""
        return ZERO

    def op(self, die: int, sc: StreamClass, ev: list, prev_t1: int | None = None) -> Cost:
        """Roofline: `aiv` (default) = memory-bound vector op, (rd + wr) / (hbm x
        vector_memory); `aic` = max(flops / (peak[dtype] x eff_c), (rd + wr) / (hbm x eff_m))
        with eff = efficiency.<name>_compute / _memory if the schema has them, else
        efficiency.gemm_<dtype> for both; dtype bf16 (default) or int8. On a decode stream
        (s0 / s1) the peak is the stream's share of the cube cores (peak x sc.aic), a vector op
        moves its bytes at min(hbm x vector_memory, its cores x aiv.b_core_gbps), and HBM is
        the die's whole bandwidth for either stream (the streams contend only through their
        dependencies)."""
        name, flops, nbytes, dims = ev[4], ev[5], ev[6] + ev[7], ev[8]
        unit = dims.get("unit", "aiv")
        if unit == "aiv":
            rate = self.k("die.hbm_gbps") * self.k("efficiency.vector_memory")
            if sc.core_bound:
                rate = min(rate, sc.cores * self.k("aiv.b_core_gbps"))
            return (nbytes / (rate * 1e3), 0.0, None)
        if unit != "aic":
            raise ProjectError(f"op {name!r}: unit {unit!r} is not one of {', '.join(OP_UNITS)}")
        dtype = dims.get("dtype", "bf16")
        if dtype not in OP_DTYPES:
            raise ProjectError(
                f"op {name!r}: dtype {dtype!r} is not one of {', '.join(OP_DTYPES)} (unit aic)"
            )
        if f"{name}_compute" in SCHEMA["efficiency"]:
            eff_c, eff_m = self.k(f"efficiency.{name}_compute"), self.k(f"efficiency.{name}_memory")
        else:
            eff_c = eff_m = self.k(f"efficiency.gemm_{dtype}")
        peak = self.k(f"die.{dtype}_tflops") * eff_c * sc.aic
        compute = flops / (peak * 1e6) if flops else 0.0
        memory = nbytes / (self.k("die.hbm_gbps") * eff_m * 1e3) if nbytes else 0.0
        return (max(compute, memory), 0.0, None)


class HostCosts:
    """The `host` profile (docs/projection.md §2 item 7): each event costs what it took here.

    A die ran all its streams on one thread, in the order of its file: `serial` makes the
    graph chain a die's events in that order (the host thread is the die's one engine), and
    each event costs the host time from the end of the die's previous event (`prev_t1`; the
    die's first event: from its own `t0`) to its own end, `t1 - prev_t1`. An acq's wait is
    derived instead: it costs only what the host took to see its words once the last of them
    had landed, `t1 - max(prev_t1, that pub's t1)` (set by the graph, which knows the pubs;
    every die's clock is the machine's one CLOCK_MONOTONIC). Zero latencies, unlimited ports.
    If the replay's times equal the host's, every event ends at its own `t1` again: that is
    the self-replay check.
    """

    serial = True

    def __init__(self) -> None:
        self.by_kind = dict.fromkeys(KINDS, self.event)

    def stream_class(self, name: str) -> StreamClass:
        """Every stream alike: host times already hold what its cores did."""
        return StreamClass(1.0, False)

    def event(self, die: int, sc: StreamClass, ev: list, prev_t1: int | None) -> Cost:
        """The event's Cost from its host times (class docstring)."""
        start = ev[2] if prev_t1 is None else prev_t1
        return (max(0, ev[3] - start) / 1e3, 0.0, None)


def cost_model(profile: Profile) -> ProfileCosts | HostCosts:
    """The cost model of `profile` (the host profile charges host times)."""
    return HostCosts() if profile.is_host else ProfileCosts(profile)


__all__ = ["COLLECTIVE_CALLS", "DECODE_STREAMS", "P2P_CALLS", "HostCosts", "ProfileCosts",
           "StreamClass", "cost_model"]  # fmt: skip
