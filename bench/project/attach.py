"""`--project PROFILE` on `xpod bench p2p`, `bench ring` and `bench alltoall`
(docs/projection.md, docs/usage.md): for every measured point a capture pod of the same
configuration (fresh, separate from the measured pod, run before any measuring so a refusal
costs no measurement), replayed on the profile; the projected figures join that point's JSON
row and a table of their own, every printed row labelled `projected (PROFILE)`.

Fields added to each xpod row (µs, 4 decimals, as `xpod project --json` rounds them):

- every bench: `profile`, `profile_sha256`, `projection_model` (the replay's contention
  model), `projection_capture_s` (the capture pod's launch + run + write, seconds),
  `projection_replay_s`, `projection_capture` (the capture's directory, with `--project-dir`);
- `projected_per_die_us`: per die of the capture pod, the p50 over the counted call ids (after
  the capture's warm-up) of the sum of that die's durations of the bench's calls with that id
  (p2p and ring: `send` + `recv`; all-to-all: `dispatch` + `combine`, A2E: `a2e` + `e2a`); a die
  with no such call: null;
- p2p: `projected_p50_us`, the p50 over calls of a one-way `send` (die 0 to die 1, a barrier
  before each, 001 §3.1's timing of a pair), and `projection_nodes` (2: the pair on two nodes,
  the default; 1 with `--project-same-node`); `async` rows are projected as the `mte` send
  (`isend(...).wait()` is what `send` runs);
- ring: `projected_round_p50_us` (die 0's round: its send's start to its recv's end, p50 over
  rounds) and `projected_p50_us` = that / dies, per hop like `p50_us_per_hop`;
- all-to-all: `projected_dispatch_us` / `projected_combine_us`, the p50 over calls of the
  latency (max over dies) of dispatch / combine (A2E rows: a2e / e2a, as the rows' measured
  dispatch / combine columns are), and `projected_total_us`, the p50 over calls of dispatch +
  combine latency of the same call id (the bench's `total_p50_us`).
"""

from __future__ import annotations

import argparse
import math
import tempfile
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from functools import partial
from pathlib import Path

from bench import common
from memory.errors import ConfigError
from runtime import PodConfig
from runtime.project import (
    CONTENTION_MODEL,
    Profile,
    ProjectError,
    Result,
    load_capture,
    load_profile,
    replay,
)
from runtime.project.result import percentile

Figures = dict[tuple, dict]  # a row's key -> the fields to add to it

PROJECT_HELP = (
    "also project every measured point on a hardware profile (cm384, h800, host, or a .toml"
    " path): a capture pod of the same configuration per point, replayed; adds to each JSON row"
    " profile, profile_sha256, {fields}, projected_per_die_us (per die: p50 over calls of its"
    " {calls} time), projection_capture_s; printed only as 'projected (PROFILE)'"
)


@dataclass(frozen=True, slots=True)
class Projection:
    """A bench's `--project`: the profile (loaded and checked when the flags are), where the
    captures go, and (p2p) how many nodes the pair spans."""

    profile: Profile
    spec: str
    keep: Path | None = None
    nodes: int | None = None

    @property
    def where(self) -> str:
        """`cm384`, or `cm384, 2 nodes` for a placed pair."""
        nodes = "" if self.nodes is None else f", {self.nodes} node{'s' * (self.nodes > 1)}"
        return f"{self.profile.name}{nodes}"

    @property
    def label(self) -> str:
        """`projected (cm384)`, or `projected (cm384, 2 nodes)` for a placed pair."""
        return f"projected ({self.where})"


# bench -> (its projected fields, the calls of its per-die figure), for --help
HELP_FIELDS: dict[str, tuple[str, str]] = {
    "p2p": ("projected_p50_us (a one-way send, die 0 to 1), projection_nodes", "send + recv"),
    "ring": ("projected_p50_us (per hop), projected_round_p50_us (die 0's round)", "send + recv"),
    "alltoall": ("projected_dispatch_us, projected_combine_us (A2E: a2e, e2a), projected_total_us"
                 " (p50 over calls of the latency, max over dies)", "dispatch + combine"),
}  # fmt: skip


def add_project_args(p: argparse.ArgumentParser, bench: str) -> None:
    """`--project P` and `--project-dir DIR` (and, for p2p's pair, `--project-same-node`)."""
    fields, calls = HELP_FIELDS[bench]
    p.add_argument("--project", default=None, metavar="PROFILE",
                   help=PROJECT_HELP.format(fields=fields, calls=calls))  # fmt: skip
    p.add_argument(
        "--project-dir",
        default=None,
        metavar="DIR",
        help="with --project: keep each capture in DIR/NAME (re-project it later with"
        " `xpod project DIR/NAME --profile P`); default: a temporary directory",
    )
    if bench == "p2p":
        p.add_argument("--project-same-node", action="store_true",
                       help="with --project: place the pair on one node (default: two nodes, as"
                       " 001 §3.1 times a pair on two servers)")  # fmt: skip


def projection_of(args: argparse.Namespace, pair: bool = False) -> Projection | None:
    """The checked `--project` flags (None without it): the profile loads now, before any pod
    starts, or a ConfigError names the flag and what is wrong."""
    spec = getattr(args, "project", None)
    keep = getattr(args, "project_dir", None)
    same = bool(getattr(args, "project_same_node", False))
    if spec is None:
        if keep is not None or same:
            flag = "--project-dir" if keep is not None else "--project-same-node"
            raise ConfigError(f"argument {flag}: only with --project PROFILE")
        return None
    try:
        profile = load_profile(spec)
    except ProjectError as e:
        raise ConfigError(f"argument --project: {e}") from None
    if keep is not None and Path(keep).exists() and not Path(keep).is_dir():
        raise ConfigError(f"argument --project-dir: {keep} exists and is not a directory")
    if pair and "kv-link" in (getattr(args, "variants", None) or ()):
        raise ConfigError(
            "argument --project: variant kv-link (a PD pod's KV link) has no capture pod;"
            " project the other --variants"
        )
    nodes = (1 if same else 2) if pair else None
    return Projection(profile, spec, Path(keep) if keep is not None else None, nodes)


def _one_host(cfg: PodConfig) -> PodConfig:
    return cfg.replace(hosts=(), fabric="auto", host_names=(), net_if="")


def _r(x: float) -> float:
    return round(float(x), 4) + 0.0


Capturer = Callable[[Path], tuple[Path, dict]]  # directory -> (capture, its cost)


def _project(proj: Projection, name: str, what: str, capture: Capturer) -> tuple:
    """Capture (into DIR/name or a temporary directory), replay; (result, its JSON, fields
    common to every bench). A projection that needs a constant the profile lacks or marks
    unknown is refused for this point only: (None, None, fields) with `projection_refused`
    naming the key, and every projected figure of the row null (never a default value)."""
    from memory.layout import LAYOUT_VERSION

    common.progress(f"capturing {what} for projection ({proj.where}) ...")
    refused = None
    with tempfile.TemporaryDirectory(prefix="xpod-capture-") as tmp:
        where = (proj.keep or Path(tmp)) / name
        path, cost = capture(where)
        t0 = time.monotonic()
        try:
            result = replay(load_capture(path, LAYOUT_VERSION), proj.profile)
            doc = result.to_json()
        except ProjectError as e:
            result = doc = None
            refused = str(e)
            common.progress(f"  {proj.label} {what}: projection refused: {e}")
        replay_s = time.monotonic() - t0
    fields = {
        "profile": proj.profile.name,
        "profile_sha256": proj.profile.sha256,
        "projection_model": CONTENTION_MODEL,
        "projection_capture_s": cost["capture_s"],
        "projection_replay_s": round(replay_s, 3),
    }
    if refused is not None:
        fields["projection_refused"] = refused
    if proj.keep is not None:
        fields["projection_capture"] = str(path)
    return result, doc, fields


def per_die_us(result: Result, names: Iterable[str], report: str) -> list[float | None]:
    """Per die: the p50 over the counted ids of call `report` (after the capture's warm-up) of
    the sum of the die's durations of calls `names` with that id; None for a die with none."""
    stats = result.calls(report)
    ids = [c for c, *_ in stats.per_call[stats.warmup :]]
    names = tuple(names)
    out: list[float | None] = []
    for die in range(result.capture.num_dies):
        vals = []
        for c in ids:
            mine = [result.durations[k] for k in ((die, n, c) for n in names)
                    if k in result.durations]  # fmt: skip
            if mine:
                vals.append(math.fsum(mine))
        out.append(_r(percentile(sorted(vals), 50)) if vals else None)
    return out


def total_p50_us(doc: dict, first: str, second: str) -> float:
    """p50 over the counted call ids of `first` + `second` latency (max over dies) of the same
    id, from `Result.to_json()`'s rounded per-call figures (so `xpod project --json` gives it)."""
    calls = doc["projected"]["calls"]
    a, b = calls[first], calls[second]
    lat_b = {c["call"]: c["max_us"] for c in b["per_call"][b["warmup"] :]}
    sums = sorted(c["max_us"] + lat_b[c["call"]] for c in a["per_call"][a["warmup"] :]
                  if c["call"] in lat_b)  # fmt: skip
    return _r(percentile(sums, 50))


# -- the benches ---------------------------------------------------------------------------------


def p2p_figures(proj: Projection | None, cfg: PodConfig, sizes: list[int], variants: list[str],
                cores: list[int]) -> Figures | None:  # fmt: skip
    """(variant, cores, size) -> fields of a one-way send's projection; sizes outermost, so a
    constant one variant needs and the profile lacks is refused on the first size."""
    from bench.project.capture import capture_p2p

    if proj is None:
        return None
    out: Figures = {}
    done: dict[tuple, dict] = {}
    base = _one_host(cfg)
    inter = proj.nodes != 1
    for size in sorted(sizes):
        for variant in variants:
            as_ = "mte" if variant == "async" else variant
            for c in cores:
                if (as_, c, size) not in done:
                    what = f"p2p {as_} c{c} {common.fmt_size(size)}B"
                    run = partial(capture_p2p, base, size, c, as_, inter_node=inter)
                    res, doc, f = _project(proj, f"p2p-{as_}-c{c}-{size}B", what, run)
                    f["projection_nodes"] = proj.nodes
                    f["projected_p50_us"] = f["projected_per_die_us"] = None
                    if res is not None:
                        f["projected_p50_us"] = doc["projected"]["calls"]["send"]["p50_us"]
                        f["projected_per_die_us"] = per_die_us(res, ("send", "recv"), "send")
                        common.progress(f"  {proj.label} {what}: p50"
                                        f" {f['projected_p50_us']:.2f} us (capture"
                                        f" {f['projection_capture_s']:.1f} s)")  # fmt: skip
                    done[(as_, c, size)] = f
                out[(variant, c, size)] = dict(done[(as_, c, size)])
    return out


def ring_figures(proj: Projection | None, pods: list[tuple[int, int]], size: int,
                 cfg_of: Callable[[int], PodConfig]) -> Figures | None:  # fmt: skip
    """(dies,) -> fields of the projection of token-ring rounds of `size` bytes (`cfg_of(dies)`:
    the ring's PodConfig)."""
    from bench.project.capture import capture_ring

    if proj is None:
        return None
    out: Figures = {}
    for dies, _ in pods:
        what = f"ring {dies} dies {common.fmt_size(size)}B"
        run = partial(capture_ring, _one_host(cfg_of(dies)), size)
        res, doc, f = _project(proj, f"ring-{dies}d-{size}B", what, run)
        out[(dies,)] = f
        f["projected_round_p50_us"] = f["projected_p50_us"] = f["projected_per_die_us"] = None
        if res is None:
            continue
        rnd = doc["projected"]["calls"]["round"]["p50_us"]
        f["projected_round_p50_us"] = rnd
        f["projected_p50_us"] = _r(rnd / dies)
        f["projected_per_die_us"] = per_die_us(res, ("send", "recv"), "round")
        common.progress(f"  {proj.label} {what}: p50 {f['projected_p50_us']:.2f} us per hop"
                        f" (capture {f['projection_capture_s']:.1f} s)")  # fmt: skip
    return out


def alltoall_key(r: dict) -> tuple:
    """The key of an all-to-all row (its pod, protocol and quantization)."""
    return (r["protocol"], r["quant"], r["dies"], r["attention_dies"], r["batch"], r["routing"])


def alltoall_figures(proj: Projection | None, points: list, quants: list[str],
                     cfg_of: Callable) -> Figures | None:  # fmt: skip
    """alltoall_key -> fields of the projection of every (point, protocol, quant) of the plan
    (`points`: options.plan's (Point, protocols); `cfg_of(pt)`: the point's PodConfig)."""
    from bench.project.capture import capture_alltoall

    if proj is None:
        return None
    out: Figures = {}
    for pt, protocols in points:
        cfg = _one_host(cfg_of(pt))
        for protocol in protocols:
            first, second = ("a2e", "e2a") if protocol == "a2e" else ("dispatch", "combine")
            for quant in quants:
                what = f"{pt.label} {protocol} {quant}"
                tag = (f"a2e{pt.attention_dies}+{pt.dies - pt.attention_dies}"
                       if pt.attention_dies else f"ep{pt.dies}")  # fmt: skip
                name = f"{tag}-b{pt.batch}-{pt.routing}-{protocol}-{quant}"
                run = partial(capture_alltoall, cfg, pt, protocol, quant)
                res, doc, f = _project(proj, name, what, run)
                key = (protocol, quant, pt.dies, pt.attention_dies, pt.batch, pt.routing)
                out[key] = f
                for k in ("dispatch", "combine", "total", "per_die"):
                    f[f"projected_{k}_us"] = None
                if res is None:
                    continue
                calls = doc["projected"]["calls"]
                f["projected_dispatch_us"] = calls[first]["p50_us"]
                f["projected_combine_us"] = calls[second]["p50_us"]
                f["projected_total_us"] = total_p50_us(doc, first, second)
                f["projected_per_die_us"] = per_die_us(res, (first, second), first)
                common.progress(
                    f"  {proj.label} {what}: {first} {f['projected_dispatch_us']:.1f} us,"
                    f" {second} {f['projected_combine_us']:.1f} us, total"
                    f" {f['projected_total_us']:.1f} us (capture {f['projection_capture_s']:.1f} s)"
                )
    return out


def attach(rows: list[dict], figures: Figures | None, key: Callable[[dict], tuple]) -> None:
    """Add each xpod row's projected fields (peer transports have none)."""
    for r in rows if figures else []:
        if str(r.get("transport", "")).startswith("xpod") and key(r) in figures:
            r.update(figures[key(r)])


# bench -> (what its projected table shows, its columns: key, header, format)
TABLES: dict[str, tuple[str, list[tuple[str, str, str]]]] = {
    "p2p": ("a one-way send (die 0 to die 1, a barrier before each) per variant, lanes, size", [
        ("variant", "variant", ""), ("cores", "cores", "d"), ("size_bytes", "size", "size"),
        ("p50_us", "measured p50_us", ".2f"), ("projected_p50_us", "proj_p50_us", ".2f"),
    ]),
    "ring": ("die 0's token round over the ring, per hop", [
        ("dies", "dies", "d"), ("size_bytes", "size", "size"),
        ("p50_us_per_hop", "measured p50_us/hop", ".2f"),
        ("projected_p50_us", "proj_us/hop", ".2f"),
        ("projected_round_p50_us", "proj_round_us", ".2f"),
    ]),
    "alltoall": ("dispatch / combine (A2E: a2e / e2a) / total latency, max over dies, p50", [
        ("protocol", "protocol", ""), ("quant", "quant", ""), ("pod", "dies", ""),
        ("batch", "batch", "d"), ("total_p50_us", "measured total_p50", ".0f"),
        ("projected_dispatch_us", "proj_disp_us", ".2f"),
        ("projected_combine_us", "proj_comb_us", ".2f"),
        ("projected_total_us", "proj_total_us", ".2f"),
    ]),
}  # fmt: skip


def print_projected(rows: list[dict], proj: Projection | None, bench: str) -> None:
    """The projected figures of `rows` as a table of their own after the measured one, every
    row labelled `projected (PROFILE)`, then the contention model and the profile's sha256."""
    mine = [{**r, "label": proj.label} for r in rows if "profile_sha256" in r] if proj else []
    if not mine:
        return
    what, columns = TABLES[bench]
    if bench == "alltoall":
        for r in mine:
            r["pod"] = (f"{r['attention_dies']}+{r['expert_dies']}" if r["attention_dies"]
                        else str(r["dies"]))  # fmt: skip
    print(f"\n{proj.label}: {what}; a capture pod of each row's configuration replayed on"
          f" profile {proj.profile.name} ({proj.profile.path})")  # fmt: skip
    common.print_table(mine, [*columns, ("projection_capture_s", "capture_s", ".1f"),
                              ("label", "", "")])  # fmt: skip
    refused = {r["projection_refused"] for r in mine if r.get("projection_refused")}
    for why in sorted(refused):  # "-" in the table: the profile lacks what the point needs
        print(f"refused (-): {why}")
    print(f"contention model: {CONTENTION_MODEL}")
    print(f"profile {proj.profile.name} sha256 {proj.profile.sha256}")


__all__ = [
    "HELP_FIELDS",
    "TABLES",
    "Projection",
    "add_project_args",
    "alltoall_figures",
    "alltoall_key",
    "attach",
    "p2p_figures",
    "per_die_us",
    "print_projected",
    "projection_of",
    "ring_figures",
    "total_p50_us",
]
