"""`xpod bench capture`: what capturing and replaying an all-to-all costs, per EP degree.

For each pod size of `--dies`, a real capture pod of the expert-parallel dispatch + combine
(`bench.project.capture`: one warm-up and two counted calls) is timed, with its dies'
resident memory sampled every second (`bench.project.memwatch`: PSS per die, the largest USS
of one die, /dev/shm used) and the capture's bytes; the synthesizer then writes the same pod's
capture, which is compared with the real one event for event (all but the host times); the
capture is loaded and replayed on `--profile`, timed. `--synth-dies` sizes (e.g. 256, more than
this machine runs) are synthesized and replayed only. The projected dispatch / combine p50
(max over dies) are printed labelled `projected (PROFILE)`.

    xpod bench capture --dies 8,16,32,64,128 --synth-dies 256 --json cap.jsonl
"""

from __future__ import annotations

import argparse
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import msgpack

from bench import common
from bench.alltoall.inputs import Point
from runtime.cli.argtypes import choice_list, int_list, output_file, positive_int

COLUMNS = [
    ("dies", "dies", "d"),
    ("capture", "capture", ""),
    ("capture_s", "capture_s", ".1f"),
    ("peak_pss_mib_per_die", "PSS_MiB/die", ".1f"),
    ("peak_uss_mib_max_die", "USS_MiB_max", ".1f"),
    ("peak_shm_mib", "shm_MiB", ".1f"),
    ("capture_mib", "log_MiB", ".1f"),
    ("events", "events", "d"),
    ("synth_s", "synth_s", ".1f"),
    ("synth_equal", "synth==real", ""),
    ("replay_s", "replay_s", ".1f"),
    ("projected_dispatch_us", "proj_disp_us", ".1f"),
    ("projected_combine_us", "proj_comb_us", ".1f"),
    ("label", "", ""),
]


def add_args(p: argparse.ArgumentParser) -> None:
    """The flags of `xpod bench capture`."""
    p.add_argument("--dies", type=int_list(2, 256), default="8,16,32",
                   help="pod sizes to capture for real (default 8,16,32; 64 and 128 fit a"
                        " 23 GiB machine, minutes each)")  # fmt: skip
    p.add_argument("--synth-dies", type=int_list(2, 1024), default=[],
                   help="pod sizes to synthesize and replay only (e.g. 256)")  # fmt: skip
    p.add_argument("--protocol", type=choice_list(("fused", "fused-dedup")), default="fused",
                   help="fused (default) or fused-dedup")  # fmt: skip
    p.add_argument("--batch", type=positive_int, default=128, help="tokens per die (128)")
    p.add_argument("--hidden", type=positive_int, default=7168, help="hidden size (7168)")
    p.add_argument("--topk", type=positive_int, default=8, help="experts per token (8)")
    p.add_argument("--experts", type=positive_int, default=256, help="routed experts (256)")
    p.add_argument("--profile", default="cm384", help="profile to replay on (default cm384)")
    p.add_argument("--keep", default=None, metavar="DIR", help="keep the captures in DIR")
    p.add_argument("--json", type=output_file, default=None, help="one JSON line per row")


@dataclass(frozen=True, slots=True)
class Options:
    dies: list[int]
    synth_dies: list[int]
    protocols: list[str]
    batch: int
    hidden: int
    topk: int
    experts: int
    profile: object  # runtime.project.Profile, loaded and checked here
    keep: str | None
    json: str | None


def parse_options(args: argparse.Namespace) -> Options:
    """The checked flags: every pod's config, the profile loaded (a bad one: exit 2 here)."""
    from bench.project.validate import a2a_config
    from runtime.project import ProjectError, load_profile

    for n in [*args.dies, *args.synth_dies]:
        if args.experts % n and n <= args.experts:
            raise ValueError(f"--experts {args.experts} do not divide over {n} dies")
    for n in args.dies:
        a2a_config(Point(n, args.batch, args.hidden, args.topk, args.experts, 0), "int8")
    try:
        profile = load_profile(args.profile)
    except ProjectError as e:
        raise ValueError(f"argument --profile: {e}") from None
    return Options(args.dies, args.synth_dies, args.protocol, args.batch, args.hidden,
                   args.topk, args.experts, profile, args.keep, args.json)  # fmt: skip


def same_events(a: Path, b: Path, dies: int) -> bool:
    """Whether two captures hold the same events, die for die, all but the host times."""
    for d in range(dies):
        name = f"die-{d:04d}.msgpack"
        x, y = (msgpack.unpackb((p / name).read_bytes(), raw=False) for p in (a, b))
        if x["streams"] != y["streams"] or len(x["events"]) != len(y["events"]):
            return False
        if any(e[:2] + e[4:] != f[:2] + f[4:] for e, f in zip(x["events"], y["events"],
                                                              strict=True)):  # fmt: skip
            return False
    return True


def one(opts: Options, dies: int, protocol: str, root: Path, real: bool) -> dict:
    """The row of one pod size: capture (real) and synthesize, compare, replay."""
    from bench.project.capture import capture_alltoall
    from bench.project.synth import synthesize_alltoall
    from bench.project.validate import a2a_config
    from memory.layout import LAYOUT_VERSION
    from runtime.project import load_capture, replay

    pt = Point(dies, opts.batch, opts.hidden, opts.topk, opts.experts, 0)
    cfg = a2a_config(pt, "int8")
    row: dict = {"bench": "capture", "dies": dies, "protocol": protocol, "quant": "int8",
                 "batch": pt.batch, "hidden": pt.hidden, "topk": pt.topk,
                 "experts": pt.num_experts}  # fmt: skip
    row["capture"] = "real" if real else "synthesized"
    syn = root / f"{protocol}-ep{dies}-synthesized"
    common.progress(f"xpod bench capture: EP{dies} {protocol}: synthesizing ...")
    t0 = time.monotonic()
    synthesize_alltoall(cfg, pt, protocol, "int8", syn)
    row["synth_s"] = round(time.monotonic() - t0, 2)
    path = syn
    if real:
        common.progress(f"xpod bench capture: EP{dies} {protocol}: capturing {dies} dies ...")
        path, cost = capture_alltoall(cfg, pt, protocol, "int8", root / f"{protocol}-ep{dies}",
                                      memory=True)  # fmt: skip
        row.update(cost)
        row["synth_equal"] = same_events(path, syn, dies)
    common.progress(f"xpod bench capture: EP{dies} {protocol}: replaying ...")
    t0 = time.monotonic()
    cap = load_capture(path, LAYOUT_VERSION)
    res = replay(cap, opts.profile)
    row["replay_s"] = round(time.monotonic() - t0, 2)
    row["events"] = cap.num_events
    row["profile"], row["profile_sha256"] = opts.profile.name, opts.profile.sha256
    row["projected_dispatch_us"] = round(res.calls("dispatch").p50_us, 4)
    row["projected_combine_us"] = round(res.calls("combine").p50_us, 4)
    row["label"] = f"projected ({opts.profile.name})"
    return row


def run(opts: Options) -> int:
    """Every size of --dies (real) and --synth-dies (synthesized), a row each."""
    rows = []
    with tempfile.TemporaryDirectory(prefix="xpod-bench-capture-") as tmp:
        root = Path(opts.keep) if opts.keep else Path(tmp)
        root.mkdir(parents=True, exist_ok=True)
        for protocol in opts.protocols:
            for dies in opts.dies:
                rows.append(one(opts, dies, protocol, root, real=True))
            for dies in opts.synth_dies:
                rows.append(one(opts, dies, protocol, root, real=False))
    common.print_table(rows, COLUMNS)
    bad = [r["dies"] for r in rows if r.get("synth_equal") is False]
    if bad:
        print(f"the synthesizer differs from the real capture at EP {bad}")
    if opts.json:
        common.write_jsonl(opts.json, rows)
    return 1 if bad else 0


def main(args: argparse.Namespace) -> int:
    return run(parse_options(args))


__all__ = ["add_args", "main", "parse_options", "run"]
