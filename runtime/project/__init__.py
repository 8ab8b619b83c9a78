"""Projected hardware time: replay a capture on a hardware profile (docs/projection.md §2-§3).

A capture directory (`capture_io`) holds every cross-die put / get / guard write, every guarded
wait, every compute op of a run, per die and stream; `replay` rebuilds its causal graph
(`graph`), charges every event from a TOML profile (`profile`, `costs`) and list-schedules it
with per-die FIFO ports; `result` holds the figures, `trace_export` writes a Perfetto trace.
Imports nothing else of xpod: a capture can be re-projected anywhere.

    cap = load_capture("runs/ep8", layout_version=memory.layout.LAYOUT_VERSION)
    res = replay(cap, load_profile("cm384"))
    res.calls("dispatch").p50_us      # projected (cm384) µs
"""

from runtime.project.capture_io import Capture, load_capture, write_capture
from runtime.project.errors import ProjectError
from runtime.project.profile import SCHEMA, Profile, load_profile
from runtime.project.replay import CONTENTION_MODEL, replay
from runtime.project.result import CallStats, Result
from runtime.project.trace_export import write_trace

__all__ = [
    "CONTENTION_MODEL",
    "SCHEMA",
    "CallStats",
    "Capture",
    "Profile",
    "ProjectError",
    "Result",
    "load_capture",
    "load_profile",
    "replay",
    "write_capture",
    "write_trace",
]
