"""Replay a capture on a profile: the list scheduler (docs/projection.md §2 item 3).

Resources (the contention model, stated in every output as `CONTENTION_MODEL`):
- one engine per (die, stream): its events run one at a time in program order, which the
  graph's program-order edges already enforce;
- two FIFO ports per die, `egress` and `ingress`, of `link.port_gbps` each. A transfer (a put,
  or a get, whose bytes flow from the peer's egress into this die's ingress) asks for both of
  its ports at once when it may start (a get: after its read latency; a DMA: after its
  startup); requests are served in order of that time, ties by `(die, stream, seq)`. It holds
  them together for `nbytes / port_gbps` (its share of the ports: a slower transfer leaves the
  rest to the next one) and ends `nbytes / min(port_gbps, cores x b_core_gbps)` after it got
  them; its bytes arrive `write_latency` after it ends.

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
    " of link.port_gbps: a transfer holds the sender's egress and the receiver's ingress together"
    " for nbytes / port_gbps in request order (ties by die, stream, seq) and ends"
    " nbytes / min(port_gbps, cores x b_core_gbps) after it got them, its bytes arriving the"
    " write latency later; a non-blocking fabric (no switch contention)"
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
        graph = build_graph(capture, cost_model(profile))
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
    cost, lat, nxt, extra, xfer = g.cost, g.lat, g.nxt, g.extra, g.xfer
    egress = [0.0] * num_dies
    ingress = [0.0] * num_dies
    heap: list[tuple[float, int]] = []
    transfers: list[tuple] = []
    work = [x for x in range(n - 1, -1, -1) if npred[x] == 0]
    done = 0
    while True:
        if work:
            x = work.pop()
            xf = xfer.get(x)
            if xf is not None:
                heappush(heap, (ready[x] + xf[0], x))
                continue
            f = ready[x] + cost[x]
            a = f + lat[x]
        elif heap:
            t, x = heappop(heap)
            _req, src, dst, port_us, xfer_us, la, eng, nbytes = xfer[x]
            e, i = egress[src], ingress[dst]
            s = e if e > t else t
            if i > s:
                s = i
            egress[src] = ingress[dst] = s + port_us
            end = s + xfer_us
            f = ready[x] + eng
            if end > f:
                f = end
            a = end + la
            transfers.append((src, dst, s, end, nbytes))
        else:
            break
        finish[x] = f
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
