"""Replay a capture on a profile: the list scheduler (docs/projection.md §2 item 3).

Resources (the contention model, stated in every output as `CONTENTION_MODEL`):
- one engine per (die, stream): its events run one at a time in program order, which the
  graph's program-order edges already enforce;
- two FIFO ports per die, `egress` and `ingress`, of `link.port_gbps` each. A transfer (a put,
  or a get, whose bytes flow from the peer's egress into this die's ingress) asks for the
  sender's egress when it may start (a get: after its read latency; a DMA: after its startup);
  requests are served in order of that time, ties by `(die, stream, seq)`. It takes
  `nbytes / port_gbps` of the egress, then as much of the receiver's ingress, from the time the
  egress started it (cut-through: a busy ingress delays the bytes' arrival, never the sender's
  next transfers). A put's stream goes on once its cores did its work and moved its bytes
  (`nbytes / (cores x b_core_gbps)`); its bytes arrive `write_latency` after both that and the
  ingress. A get, and a DMA put, waits for its transfer.

The scheduler: nodes whose predecessors are all done are either computed at once (an event
that takes no port: its finish is `ready + cost`, whatever else happens, so the order in which
those are computed changes nothing) or queued for the ports in a heap keyed by `(request time,
node)` (node order is `(die, stream, seq)` order). The heap pops in non-decreasing time (every
cost and latency is >= 0), so the ports serve requests in projected-time order: FIFO. Only
floats derived from the capture's counts and the profile enter: the same capture and profile
give the same bits on any machine (host times enter only under the `host` profile).
"""

from __future__ import annotations

from heapq import heappop, heappush

from runtime.project.capture_io import Capture, paused_gc
from runtime.project.costs import cost_model
from runtime.project.errors import ProjectError
from runtime.project.graph import KINDS, Graph, build_graph
from runtime.project.profile import Profile
from runtime.project.result import Result

CONTENTION_MODEL = (
    "one engine per (die, stream) in program order; per die one egress and one ingress FIFO port"
    " of link.port_gbps, served in request order (ties by die, stream, seq): a transfer takes"
    " nbytes / port_gbps of the sender's egress, then of the receiver's ingress (from the time"
    " the egress started it, cut-through; a busy ingress delays the bytes, not the sender's next"
    " transfers); a put's stream goes on once its cores did its work and moved its bytes"
    " (nbytes / (cores x b_core_gbps)), its bytes arriving the write latency after both; a get"
    " (and a DMA put) waits for its transfer; a non-blocking fabric (no switch contention);"
    " the decode streams s0 / s1 compute on their share of the die's cube cores and read HBM"
    " at its full rate (they contend only through their dependencies)"
)
HOST_MODEL = (
    "host: a die's events one at a time in the order of its file (the die's one thread on the"
    " capturing machine), each charged its measured time; zero latencies, unlimited ports"
)


def replay(capture: Capture, profile: Profile) -> Result:
    """Project `capture` on `profile` (docs/projection.md §2): build the graph, schedule it,
    return the Result. Raises ProjectError for an incomplete trace or a constant the profile
    lacks."""
    with paused_gc():
        model = cost_model(profile)
        nodes = capture.meta.get("nodes")
        if nodes is not None and not profile.is_host:
            if not isinstance(nodes, list) or len(nodes) != capture.num_dies:
                raise ProjectError(f"{capture.path}: meta.json nodes: a node for each of the"
                                   f" {capture.num_dies} dies, got {nodes!r}")  # fmt: skip
            model.nodes = [int(x) for x in nodes]
        graph = build_graph(capture, model)
        ready, finish, transfers = schedule(graph, capture.num_dies)
    model = HOST_MODEL if profile.is_host else CONTENTION_MODEL
    return Result(capture, profile, graph, ready, finish, transfers, model)


def schedule(g: Graph, num_dies: int) -> tuple[list[float], list[float], list[tuple]]:
    """Projected times of every node: (ready, finish, transfers).

    ready[x]: when x's predecessors allowed it to start; finish[x]: when it was done.
    transfers: (src die, dst die, start µs, end µs, nbytes) of each port transfer, in the order
    the ports served them.
    """
    n = g.n
    ready = [0.0] * n
    finish = [0.0] * n
    npred = list(g.npred)
    cost, lat, nxt, extra, xfer, floor = g.cost, g.lat, g.nxt, g.extra, g.xfer, g.floor
    arrival = [0.0] * n
    egress = [0.0] * num_dies
    ingress = [0.0] * num_dies
    heap: list[tuple[float, int, int]] = []  # (time, stage, node): 0 egress, 1 ingress
    started: dict[int, float] = {}  # node -> when its egress started it
    transfers: list[tuple] = []
    work = [x for x in range(n - 1, -1, -1) if npred[x] == 0]
    done = 0
    while True:
        if work:
            x = work.pop()
            xf = xfer.get(x)
            if xf is not None:
                heappush(heap, (ready[x] + xf[0], 0, x))
                continue
            f = ready[x] + cost[x]
            a = f + lat[x]
            if floor:  # a pub's words land after the data its stream sent the peer before
                put = floor.get(x)
                if put is not None and arrival[put] > a:
                    a = arrival[put]
        elif heap:
            t, stage, x = heappop(heap)
            _req, src, dst, port_us, xfer_us, la, eng, nbytes = xfer[x]
            # two FIFO servers in a row, each in the order of the time it is asked: the
            # sender's egress, then (from the time the egress started it: cut-through) the
            # receiver's ingress; a busy receiver delays the bytes, not the sender's next
            # transfers
            if stage == 0:
                e = egress[src]
                s = e if e > t else t
                egress[src] = s + port_us
                started[x] = s
                heappush(heap, (s, 1, x))
                continue
            s = started.pop(x)
            i = ingress[dst]
            si = i if i > s else s
            ingress[dst] = si + port_us
            end = s + xfer_us
            if si + port_us > end:
                end = si + port_us
            if eng:  # a put by the stream's cores: they go on once they moved its bytes,
                f = ready[x] + eng  # which arrive once the ports carried them too
                a = (end if end > f else f) + la
            else:  # a get, or the DMA engine's put: the stream waits for the transfer
                f = end if end > ready[x] else ready[x]
                a = end + la
            transfers.append((src, dst, s, end, nbytes))
        else:
            break
        finish[x] = f
        arrival[x] = a
        done += 1
        if nxt[x]:
            y = x + 1
            if f > ready[y]:
                ready[y] = f
            c = npred[y] - 1
            npred[y] = c
            if not c:
                work.append(y)
        ex = extra[x]
        if ex is not None:
            for y in ex:
                if y < 0:
                    y = ~y
                    v = a
                else:
                    v = f
                if v > ready[y]:
                    ready[y] = v
                c = npred[y] - 1
                npred[y] = c
                if not c:
                    work.append(y)
    if done < n:
        _stuck(g, npred, n - done)
    return ready, finish, transfers


def _stuck(g: Graph, npred: list[int], count: int) -> None:
    x = next(i for i in range(g.n) if npred[i] > 0)
    die, stream, seq = g.locate(x)
    raise ProjectError(
        f"trace cannot complete: die {die} stream {stream} seq {seq} ({KINDS[g.kind[x]]}) and"
        f" {count - 1} more events never became ready: their predecessors wait on them (a cycle"
        " of after / end / acq edges)"
    )


__all__ = ["CONTENTION_MODEL", "HOST_MODEL", "replay", "schedule"]
