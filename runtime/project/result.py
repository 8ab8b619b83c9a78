"""A projection's figures (docs/projection.md §2 item 5), every one in projected µs.

- per call (`begin` .. `end` on a die): its duration, from the start of the begin's own work
  (`finish(begin) - its own cost`) to `finish(end)`;
- per call id: the latency as the benchmarks define it (max over the dies that ran it) and the
  mean over those dies; per call name p50 / p99 / max of the latency over the call ids after
  the capture's warm-up (the lowest `warmup` ids of each name);
- per die: `end_us` (its last event's finish) and `busy_us` (the sum over its events of
  `finish - ready`: time its streams were taken by an event, not waiting for a predecessor);
- port use: bytes per time bin of each die's egress and ingress (`PORT_BINS` bins over the
  makespan; a transfer's bytes spread evenly over its duration).

`to_json()` rounds every float to 4 decimals and port bytes to integers, so the JSON of the same
capture and profile is byte-identical (`json.dumps(..., sort_keys=True)`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import cached_property
from itertools import pairwise
from operator import sub

import numpy as np

from runtime.project.capture_io import Capture
from runtime.project.errors import ProjectError
from runtime.project.graph import Graph
from runtime.project.profile import Profile

PORT_BINS = 100


@dataclass(frozen=True, slots=True)
class CallStats:
    """One call name's figures, µs. per_call: (call id, max over dies, mean over dies, dies)
    for every call id, warm-up included; p50 / p99 / max / mean_p50 over the counted ones."""

    name: str
    warmup: int
    per_call: list[tuple[int, float, float, int]]
    counted: int
    p50_us: float
    p99_us: float
    max_us: float
    mean_p50_us: float


@dataclass(frozen=True, slots=True)
class PortSeries:
    """Bytes per time bin: egress[d][k] / ingress[d][k] over [k, k + 1) x bin_us."""

    bin_us: float
    egress: np.ndarray
    ingress: np.ndarray


class Result:
    """The projection of one capture on one profile (module docstring)."""

    def __init__(self, capture: Capture, profile: Profile, graph: Graph, ready: list[float],
                 finish: list[float], transfers: list[tuple], contention_model: str):  # fmt: skip
        self.capture = capture
        self.profile = profile
        self.graph = graph
        self.ready = ready
        self.finish = finish
        self.transfers = transfers
        self.contention_model = contention_model
        self.durations: dict[tuple[int, str, int], float] = {
            (die, name, call): finish[e] - (finish[b] - own)
            for die, name, call, b, e, own in graph.calls
        }

    def times(self, die: int, stream: int, seq: int) -> tuple[float, float]:
        """(ready, finish) µs of event `seq` of die `die`'s stream `stream`."""
        starts = self.graph.base[die]
        end = starts[stream + 1] if stream + 1 < len(starts) else self.graph.die_start[die + 1]
        x = starts[stream] + seq
        if not starts[stream] <= x < end:
            raise IndexError(f"die {die} stream {stream} has {end - starts[stream]} events")
        return self.ready[x], self.finish[x]

    @property
    def makespan_us(self) -> float:
        """The last event's finish over every die."""
        return max(self.finish, default=0.0)

    def call_names(self) -> list[str]:
        """The names to report: meta.json's calls, else every name the capture has, sorted."""
        named = self.capture.call_names()
        return named if named is not None else sorted({k[1] for k in self.durations})

    @cached_property
    def measured_durations(self) -> dict[tuple[int, str, int], float]:
        """Per call as the capturing host timed it (µs): the `end`'s t1 minus the `begin`'s
        t0 on the die (a synthesized capture has no host times: all 0)."""
        ev, idx = self.capture.events, self.graph.file_idx
        return {(die, name, call): (ev[die][idx[e]][3] - ev[die][idx[b]][2]) / 1e3
                for die, name, call, b, e, _own in self.graph.calls}  # fmt: skip

    def measured_calls(self, name: str) -> CallStats:
        """`calls(name)` from the host's own times (the self-replay check compares the two
        under the `host` profile, docs/projection.md §2 item 7)."""
        return self.calls(name, self.measured_durations)

    def calls(self, name: str, durations: dict | None = None) -> CallStats:
        """Figures of call `name` (from `durations`, default the projected ones); ProjectError
        if the capture has none after warm-up."""
        by_id: dict[int, list[float]] = {}
        durations = self.durations if durations is None else durations
        for (_die, nm, call), dur in durations.items():  # (die, name, call) order: sorted
            if nm == name:
                by_id.setdefault(call, []).append(dur)
        warmup = self.capture.warmup()
        per_call = [(c, max(v), math.fsum(v) / len(v), len(v)) for c, v in sorted(by_id.items())]
        counted = per_call[warmup:]
        if not counted:
            raise ProjectError(
                f"capture {self.capture.path}: call {name!r}: {len(per_call)} calls, none after"
                f" the {warmup} warm-up calls (meta.json warmup)"
            )
        lat = sorted(c[1] for c in counted)
        means = sorted(c[2] for c in counted)
        return CallStats(name, warmup, per_call, len(counted), percentile(lat, 50),
                         percentile(lat, 99), lat[-1], percentile(means, 50))  # fmt: skip

    @cached_property
    def die_end_us(self) -> list[float]:
        """Per die: its last event's finish (µs)."""
        f, starts = np.asarray(self.finish), self.graph.die_start
        return [float(f[a:b].max()) if b > a else 0.0 for a, b in pairwise(starts)]

    @cached_property
    def die_busy_us(self) -> list[float]:
        """Per die: the sum over its events of finish - ready (µs)."""
        # fsum: exactly rounded, so the figure cannot depend on a summation order
        f, r = self.finish, self.ready
        return [math.fsum(map(sub, f[a:b], r[a:b])) for a, b in pairwise(self.graph.die_start)]

    @cached_property
    def ports(self) -> PortSeries:
        """Bytes per time bin of every die's egress and ingress (PORT_BINS bins)."""
        return port_series(self.transfers, self.capture.num_dies, self.makespan_us, PORT_BINS)

    def to_json(self) -> dict:
        """The figures as a JSON-ready dict (rounded: module docstring)."""
        calls = {}
        for name in self.call_names():
            st = self.calls(name)
            calls[name] = {
                "count": st.counted, "warmup": st.warmup, "p50_us": _r(st.p50_us),
                "p99_us": _r(st.p99_us), "max_us": _r(st.max_us),
                "mean_p50_us": _r(st.mean_p50_us),
                "per_call": [{"call": c, "max_us": _r(mx), "mean_us": _r(mn), "dies": k}
                             for c, mx, mn, k in st.per_call],
            }  # fmt: skip
            if self.profile.is_host and not self.capture.meta.get("synthesized"):
                m = self.measured_calls(name)  # the self-replay check: the host's own p50
                calls[name]["measured_p50_us"] = _r(m.p50_us)
                calls[name]["self_replay_error"] = _r(st.p50_us / m.p50_us - 1 if m.p50_us else 0)
        ports = self.ports
        meta = self.capture.meta
        return {
            "profile": self.profile.name,
            "profile_sha256": self.profile.sha256,
            "contention_model": self.contention_model,
            "capture": {
                "workload": meta.get("workload", {}),
                "num_dies": self.capture.num_dies,
                "events": self.graph.n,
                "synthesized": bool(meta.get("synthesized", False)),
            },
            "projected": {
                "unit": "us",
                "makespan_us": _r(self.makespan_us),
                "calls": calls,
                "dies": {
                    "end_us": [_r(x) for x in self.die_end_us],
                    "busy_us": [_r(x) for x in self.die_busy_us],
                },
                "ports": {
                    "bin_us": _r(ports.bin_us),
                    "egress_bytes": _bytes(ports.egress),
                    "ingress_bytes": _bytes(ports.ingress),
                },
            },
        }


def _bytes(rows: np.ndarray) -> list[list[int]]:
    return [[round(float(b)) for b in row] for row in rows]


def _r(x: float) -> float:
    return round(float(x), 4) + 0.0  # + 0.0: never a "-0.0" in the JSON


def percentile(sorted_vals: list[float], q: float) -> float:
    """The q-th percentile of ascending `sorted_vals`, linear between ranks (numpy's default)."""
    pos = (len(sorted_vals) - 1) * q / 100
    lo = int(pos)
    hi = min(lo + 1, len(sorted_vals) - 1)
    return sorted_vals[lo] + (sorted_vals[hi] - sorted_vals[lo]) * (pos - lo)


def port_series(transfers: list[tuple], num_dies: int, span_us: float, bins: int) -> PortSeries:
    """Bytes per bin of each die's egress and ingress; `transfers` as `replay.schedule` gives
    them: (src, dst, start µs, end µs, nbytes), each moving its bytes at a constant rate.

    The bytes a port moved by time t are a sum of ramps, `sum_k w_k (t - x_k)` over the kinks
    x_k < t (+rate at a start, -rate at an end): sorted kinks and two running sums give it at
    every bin edge for the cost of a sort, whatever the transfers' count.
    """
    egress = np.zeros((num_dies, bins))
    ingress = np.zeros((num_dies, bins))
    arr = np.array(transfers, dtype=np.float64).reshape(-1, 5)
    arr = arr[(arr[:, 4] > 0) & (arr[:, 3] > arr[:, 2])]
    if span_us <= 0 or not len(arr):
        return PortSeries(span_us / bins if bins else 0.0, egress, ingress)
    edges = np.linspace(0.0, span_us, bins + 1)
    rate = arr[:, 4] / (arr[:, 3] - arr[:, 2])
    x = np.concatenate((arr[:, 2], arr[:, 3]))
    w = np.concatenate((rate, -rate))
    for col, out in ((0, egress), (1, ingress)):
        die = np.concatenate((arr[:, col], arr[:, col])).astype(np.int64)
        order = np.lexsort((x, die))
        xs, ws, ds = x[order], w[order], die[order]
        bounds = np.searchsorted(ds, np.arange(num_dies + 1))
        for d in range(num_dies):
            lo, hi = int(bounds[d]), int(bounds[d + 1])
            if lo == hi:
                continue
            k = np.searchsorted(xs[lo:hi], edges, side="left")
            cw = np.concatenate(([0.0], np.cumsum(ws[lo:hi])))
            cwx = np.concatenate(([0.0], np.cumsum(ws[lo:hi] * xs[lo:hi])))
            out[d] = np.maximum(np.diff(edges * cw[k] - cwx[k]), 0.0)
    return PortSeries(span_us / bins, egress, ingress)


__all__ = ["PORT_BINS", "CallStats", "PortSeries", "Result", "percentile", "port_series"]
