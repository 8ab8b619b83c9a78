"""`xpod project CAPTURE_DIR --profile P`: re-project a saved capture on a hardware profile.

Prints, per call name, the projected p50 / p99 / max latency (a call's latency: the max over
the dies that ran it), each row labeled `projected (PROFILE)`, then the contention model and the
profile's sha256. `--json F` writes `Result.to_json()`, `--trace F` a Perfetto trace, each by
rename once whole; every refusal (`xpod project: error: ...`, exit status 2) comes before
either is written. docs/projection.md is the contract.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from dataclasses import dataclass
from pathlib import Path

from runtime.cli.argtypes import error_line, output_file


@dataclass(frozen=True, slots=True)
class ProjectOptions:
    capture: str
    profile: str
    json: str | None
    trace: str | None
    prog: str


def add_args(p: argparse.ArgumentParser) -> None:
    """The flags of `xpod project`."""
    p.add_argument("capture", nargs="?", default=None, metavar="CAPTURE_DIR",
                   help="a capture directory (meta.json + die-NNNN.msgpack)")  # fmt: skip
    p.add_argument("--profile", required=True, metavar="P",
                   help="cm384, h800, host (self-replay) or a path to a profile .toml")  # fmt: skip
    p.add_argument("--json", type=output_file, default=None, metavar="F",
                   help="write the projected figures as JSON")  # fmt: skip
    p.add_argument("--trace", type=output_file, default=None, metavar="F",
                   help="write a Perfetto (Chrome trace-event) file, projected times")  # fmt: skip


def parse_options(args: argparse.Namespace) -> ProjectOptions:
    """The checked options (loading the capture and the profile is `run`'s: it may refuse)."""
    if args.capture is None:
        raise ValueError("the following arguments are required: CAPTURE_DIR")
    return ProjectOptions(args.capture, args.profile, args.json, args.trace, args.cmd_prog)


def run(opts: ProjectOptions) -> int:
    """Load, replay, print, write; a ProjectError is one line on stderr and status 2."""
    from memory.layout import LAYOUT_VERSION
    from runtime.project import ProjectError, load_capture, load_profile, replay
    from runtime.project.trace_export import write_trace

    try:  # every refusal happens here, before anything is written
        profile = load_profile(opts.profile)
        result = replay(load_capture(opts.capture, LAYOUT_VERSION), profile)
        doc = result.to_json()
    except ProjectError as e:
        sys.stderr.write(error_line(opts.prog, e))
        return 2
    print_table(doc, opts.capture)
    if opts.json:
        out = Path(opts.json)
        tmp = out.with_name(out.name + ".tmp")
        tmp.write_text(json.dumps(doc, indent=1, sort_keys=True) + "\n", encoding="utf-8")
        os.replace(tmp, out)
    if opts.trace:
        write_trace(result, opts.trace)
    return 0


def print_table(doc: dict, capture: str) -> None:
    """The figures of `doc` (Result.to_json()) as a small table, every row labeled."""
    label = f"projected ({doc['profile']})"
    cap = doc["capture"]
    made = "synthesized" if cap["synthesized"] else "captured"
    print(f"{capture}: {cap['num_dies']} dies, {cap['events']} events ({made});"
          f" workload {json.dumps(cap['workload'], sort_keys=True)}")  # fmt: skip
    print(f"{'call':<12} {'calls':>6} {'warm-up':>8} {'p50 us':>10} {'p99 us':>10}"
          f" {'max us':>10} {'die-mean p50 us':>16}")  # fmt: skip
    for name, c in doc["projected"]["calls"].items():
        figures = (f"{c['p50_us']:>10.2f} {c['p99_us']:>10.2f} {c['max_us']:>10.2f}"
                   f" {c['mean_p50_us']:>16.2f}")  # fmt: skip
        print(f"{name:<12} {c['count']:>6} {c['warmup']:>8} {figures}  {label}")
        if "measured_p50_us" in c:  # the host profile: the self-replay check
            print(f"{'':<12} {'':>6} {'':>8} {c['measured_p50_us']:>10.2f}  measured on the"
                  f" capturing host (self-replay error {c['self_replay_error']:+.1%})")  # fmt: skip
    print(f"makespan {doc['projected']['makespan_us']:.2f} us  {label}")
    print(f"contention model: {doc['contention_model']}")
    print(f"profile {doc['profile']} sha256 {doc['profile_sha256']}")
