"""The event graph of a capture (docs/projection.md §1.2, §2 item 2), in flat lists.

Nodes are events, numbered die by die, stream by stream, seq by seq: node order IS the
`(die, stream, seq)` order the scheduler breaks ties by, and an event's program-order successor
is simply the next node (`nxt[g]` says whether it is in the same stream). Edges besides program
order are kept in `extra[g]`, a list of encoded successors: `s` (released when g is done) or
`~s` (released when g's bytes or words have ARRIVED at the peer):

- `after` <- the event it names (done);  `end` <- each of its joins (done);
- data before guard: a `pub`'s words arrive no earlier than the last earlier `put` of its
  stream to the same peer (`floor[pub]` = that put): the stream's writes to a peer are
  delivered in order (one MTE queue), so the guard follows the data without the stream
  waiting for the data to land. Puts of one stream end in program order and share the pair's
  latency, so the last one's arrival is the latest of them all. Only the pub's own stream
  counts: how a die's streams interleave in its file is the host's timing, which no projection
  may read;
- `acq` <- for each of its words, the `pub` of the word's writer to this die that sets it to
  the smallest value >= the target (equal values: the lowest seq, then the lowest stream);
  one edge per distinct pub (arrived). No such pub: "trace incomplete".
- the host profile only (`model.serial`): each event <- the die's previous event in its file,
  where that is another stream's (done): the die's one host thread ran them in that order.
"""

from __future__ import annotations

from bisect import bisect_left, bisect_right
from dataclasses import dataclass, field

from runtime.project.capture_io import KINDS, Capture
from runtime.project.costs import HostCosts, ProfileCosts
from runtime.project.errors import ProjectError

KIND_CODE = {k: i for i, k in enumerate(KINDS)}
PUT, GET, PUB, ACQ, OP, COPY, BEGIN, END, AFTER = range(len(KINDS))


@dataclass(slots=True)
class Graph:
    """The flat event graph (module docstring). Per node g: kind[g] (a KINDS index), cost[g],
    lat[g] (costs.Cost), nxt[g], extra[g], npred[g] (edges in, program order
    included), file_idx[g] (the
    event's index in its die file); xfer: node -> transfer tuple (costs.Cost)."""

    n: int
    kind: list[int]
    cost: list[float]
    lat: list[float]
    nxt: bytearray
    extra: list
    npred: list[int]
    file_idx: list[int]
    xfer: dict[int, tuple]
    base: list[list[int]]  # base[die][stream]: the node of seq 0
    floor: dict[int, int] = field(default_factory=dict)  # pub -> the put its words follow
    die_start: list[int] = field(default_factory=list)  # die d's nodes: die_start[d]..[d + 1]
    stream_base: list[int] = field(default_factory=list)  # sorted: the first node of each stream
    stream_key: list[tuple[int, int]] = field(default_factory=list)  # its (die, stream)
    calls: list[tuple[int, str, int, int, int, float]] = field(default_factory=list)
    # calls: (die, name, call id, begin node, end node, the begin's own µs), sorted: a call
    # starts when its begin's own work does (the host profile charges a begin the time before
    # it too, which is the caller's, not the call's)

    def locate(self, g: int) -> tuple[int, int, int]:
        """(die, stream, seq) of node g."""
        i = bisect_right(self.stream_base, g) - 1
        die, stream = self.stream_key[i]
        return die, stream, g - self.stream_base[i]

    def add_edge(self, src: int, dst: int, on_arrival: bool = False) -> None:
        """dst waits for src to be done (or, on_arrival, for src's bytes / words to arrive)."""
        ex = self.extra[src]
        if ex is None:
            ex = self.extra[src] = []
        ex.append(~dst if on_arrival else dst)
        self.npred[dst] += 1


def build_graph(capture: Capture, model: ProfileCosts | HostCosts) -> Graph:
    """The graph of `capture` with every node's cost from `model`. Raises ProjectError for an
    unmatched acq ("trace incomplete"), a call that begins and never ends, or a constant the
    profile lacks (naming the event that needs it)."""
    n = capture.num_events
    g = Graph(n, [0] * n, [0.0] * n, [0.0] * n, bytearray(n), [None] * n, [0] * n, [0] * n,
              {}, [])  # fmt: skip
    # (writer, owner die, word) -> [(value, seq, stream, node)] of the pubs setting it
    pubs: dict[tuple[int, int, int], list] = {}
    acqs: list[tuple[int, int, list]] = []  # (node, die, event)
    waits: list[tuple[int, int, int, int]] = []  # (node, die, stream, seq): after / end joins
    begins: dict[tuple[int, str, int], int] = {}
    ends: dict[tuple[int, str, int], int] = {}
    node = 0
    for die in range(capture.num_dies):
        g.die_start.append(node)
        node = _add_die(g, capture, model, die, node, pubs, acqs, waits, begins, ends)
    g.die_start.append(node)
    for dst, die, stream, seq in waits:
        g.add_edge(g.base[die][stream] + seq, dst)
    for key in pubs:
        pubs[key].sort()
    for acq, die, ev in acqs:
        found = _match(g, capture, pubs, acq, die, ev)
        if model.serial:  # the host profile: the acq's detection delay once its words landed
            landed = max(capture.events[w][g.file_idx[pub]][3] for pub, w in found.items())
            prev = capture.events[die][g.file_idx[acq] - 1][3] if g.file_idx[acq] else ev[2]
            g.cost[acq] = max(0, ev[3] - max(prev, landed)) / 1e3
    g.calls = _pair_calls(g, capture, begins, ends, model.serial)
    return g


def _add_die(g: Graph, capture: Capture, model, die: int, node: int, pubs: dict, acqs: list,
             waits: list, begins: dict, ends: dict) -> int:  # fmt: skip
    """Add die `die`'s events as nodes `node`.. (stream by stream); returns the next node."""
    events, names = capture.events[die], capture.streams[die]
    by_stream: list[list[int]] = [[] for _ in names]
    for i, ev in enumerate(events):
        by_stream[ev[1]].append(i)
    g.base.append([])
    kind, cost, lat, nxt, npred, file_idx, xfer = (g.kind, g.cost, g.lat, g.nxt, g.npred,
                                                   g.file_idx, g.xfer)  # fmt: skip
    by_kind = model.by_kind
    node_of = [0] * len(events)
    for s, idxs in enumerate(by_stream):
        g.base[die].append(node)
        if not idxs:
            continue  # (and its class, which may need a constant, is never asked for)
        g.stream_base.append(node)
        g.stream_key.append((die, s))
        sc = model.stream_class(names[s])
        last_put: dict[int, int] = {}
        for seq, i in enumerate(idxs):
            ev = events[i]
            k = ev[0]
            node_of[i] = node
            try:
                c, la, xf = by_kind[k](die, sc, ev, events[i - 1][3] if i else None)
            except ProjectError as e:
                raise ProjectError(f"die {die} stream {s} ({names[s]}) seq {seq} ({k}): {e}") from e
            kind[node], cost[node], lat[node], file_idx[node] = KIND_CODE[k], c, la, i
            if xf is not None:
                xfer[node] = xf
            nxt[node] = seq + 1 < len(idxs)
            if seq:
                npred[node] += 1
            if k == "put":
                last_put[ev[4]] = node
            elif k == "pub":
                _add_pub(g, pubs, last_put, die, s, seq, node, ev)
            elif k == "acq":
                acqs.append((node, die, ev))
            elif k == "after":
                waits.append((node, die, ev[4], ev[5]))
            elif k == "end":
                waits.extend((node, die, js, jq) for js, jq in ev[6])
                _once(ends, (die, ev[4], ev[5]), node, "ends", die, s, seq)
            elif k == "begin":
                _once(begins, (die, ev[4], ev[5]), node, "begins", die, s, seq)
            node += 1
    if model.serial:
        _chain_file_order(g, events, node_of)
    return node


def _chain_file_order(g: Graph, events: list, node_of: list[int]) -> None:
    """The host profile: each event of a die after the die's previous one in its file (the
    die's one host thread), where program order does not already say so."""
    for i in range(1, len(events)):
        if events[i][1] != events[i - 1][1]:
            g.add_edge(node_of[i - 1], node_of[i])


def _add_pub(g: Graph, pubs: dict, last_put: dict, die: int, s: int, seq: int, node: int,
             ev: list) -> None:  # fmt: skip
    put = last_put.get(ev[4])
    if put is not None:
        g.floor[node] = put
    peer = ev[4]
    for w, v in zip(ev[5], ev[6], strict=True):
        key = (die, peer, w)
        lst = pubs.get(key)
        if lst is None:
            lst = pubs[key] = []
        lst.append((v, seq, s, node))


def _once(table: dict, key: tuple, node: int, verb: str, die: int, s: int, seq: int) -> None:
    if key in table:
        raise ProjectError(
            f"die {die} stream {s} seq {seq}: call {key[1]} #{key[2]} {verb} twice on this die"
        )
    table[key] = node


def _match(g: Graph, capture: Capture, pubs: dict, acq: int, die: int, ev: list) -> dict:
    """Edges from the pubs that satisfy `acq`'s words (docs/projection.md §1.2); returns
    {pub node: its writer die}."""
    found: dict[int, int] = {}  # distinct pubs, in the order of the acq's words
    for w, t, p in zip(ev[4], ev[5], ev[6], strict=True):
        lst = pubs.get((p, die, w))
        j = 0 if lst is None else bisect_left(lst, (t,))
        if lst is None or j == len(lst):
            _, s, seq = g.locate(acq)
            raise ProjectError(
                f"trace incomplete: die {die} stream {s} seq {seq} waits for word {w} >= {t} of"
                f" die {p}, never written (field {ev[7]}, stream {capture.streams[die][s]})"
            )
        found[lst[j][3]] = p
    for pub in found:
        g.add_edge(pub, acq, on_arrival=True)
    return found


def _pair_calls(g: Graph, capture: Capture, begins: dict, ends: dict, host: bool) -> list:
    calls = []
    for key, b in begins.items():
        e = ends.get(key)
        if e is None:
            die, s, seq = g.locate(b)
            raise ProjectError(
                f"trace incomplete: die {die} stream {s} seq {seq}: call {key[1]} #{key[2]} begins"
                " and never ends"
            )
        ev = capture.events[key[0]][g.file_idx[b]]
        own = (ev[3] - ev[2]) / 1e3 if host else g.cost[b]
        calls.append((key[0], key[1], key[2], b, e, own))
    for key, e in ends.items():
        if key not in begins:
            die, s, seq = g.locate(e)
            raise ProjectError(
                f"die {die} stream {s} seq {seq}: call {key[1]} #{key[2]} ends and never began"
            )
    calls.sort()
    return calls


__all__ = ["KINDS", "Graph", "build_graph"]
