"""`xpod project --validate`: every published point, projected and judged (docs/projection.md §4).

For each point of `bench.project.points` on the profile, the capture it needs is made (or
reused from `--captures DIR`): Table 7's EP pods as real capture pods up to `real_upto` dies and
synthesized above (`bench.project.synth`, tested event for event equal to real captures at
every size this machine runs); 001 §3.1's pair of dies as real 2-die capture pods on two nodes;
000 Table 1's 512 B write as a hand-built two-event trace (a put and its flag: the figure is a
single write, no protocol of xpod's does only that); 001 §3.3's A2E / E2A domain synthesized.
Each capture is replayed on the profile once and every point reads its figure from the replay.
The rows say which kind of capture each point came from.
"""

from __future__ import annotations

import json
import shutil
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from bench.alltoall.inputs import Point
from bench.project.capture import capture_alltoall, capture_p2p
from bench.project.points import FROZEN, PubPoint, judge, points_of
from memory.layout import LAYOUT_VERSION
from runtime import PodConfig
from runtime.project import Profile, Result, load_capture, replay
from runtime.project import write_capture as write_trace_dir

SPEC = "xpod-validate.json"  # in each capture directory: what it was made for (reuse check)
REAL_UPTO = 16  # default: Table 7 pods of at most this many dies are captured for real
WRITE_WORD = 8  # the hand-built write's flag word (any word: one writer, starts at 0)


def a2a_config(pt: Point, quant: str) -> PodConfig:
    """The capture pod of an all-to-all point (the bench's shape, an unused 1 MiB app area)."""
    n_exp = pt.dies - pt.attention_dies
    return PodConfig(num_dies=pt.dies, app_bytes=1 << 20, a2a_max_batch=pt.batch,
                     a2a_hidden=pt.hidden, a2a_topk=pt.topk, num_experts=pt.num_experts,
                     a2a_max_local_experts=pt.num_experts // n_exp if pt.attention_dies else 0,
                     a2a_dispatch_dtype="int8" if quant == "int8" else "float32")  # fmt: skip


@dataclass
class Captures:
    """Makes or reuses the captures of the points (one directory per workload)."""

    root: Path
    real_upto: int = REAL_UPTO
    recapture: bool = False
    log: Callable[[str], None] = lambda s: print(s, file=sys.stderr, flush=True)
    made: dict[str, dict] = field(default_factory=dict)  # dir name -> how it was made, cost

    def get(self, name: str, spec: dict, make: Callable[[Path], dict]) -> Path:
        """The capture `name` of `spec`: reused when its directory holds a complete capture
        made for the same spec and layout, else made by `make(dir)` (returns its cost)."""
        path = self.root / name
        want = {"spec": spec, "layout_version": LAYOUT_VERSION}
        fresh = not self.recapture and (path / "meta.json").exists() and (path / SPEC).exists()
        if fresh and json.loads((path / SPEC).read_text()) == want:
            self.made.setdefault(name, {"reused": True, **want})
            return path
        if path.exists():
            shutil.rmtree(path)
        t0 = time.monotonic()
        self.log(f"capture {name} ...")
        cost = make(path) or {}
        (path / SPEC).write_text(json.dumps(want, sort_keys=True))
        self.made[name] = {"reused": False, "seconds": round(time.monotonic() - t0, 2), **cost}
        return path

    # -- the workloads --------------------------------------------------------------------------

    def alltoall(self, w: dict) -> tuple[Path, str]:
        pt = Point(w["dies"], w["batch"], w["hidden"], w["topk"], w["experts"], 0)
        how = "real" if w["dies"] <= self.real_upto else "synthesized"
        name = f"{w['protocol']}-{w['quant']}-ep{w['dies']}-b{w['batch']}-{how}"
        cfg = a2a_config(pt, w["quant"])

        def make(path: Path) -> dict:
            if how == "real":
                return capture_alltoall(cfg, pt, w["protocol"], w["quant"], path)[1]
            from bench.project.synth import synthesize_alltoall

            synthesize_alltoall(cfg, pt, w["protocol"], w["quant"], path)
            return {}

        return self.get(name, {**w, "capture": how}, make), how

    def a2e(self, w: dict) -> tuple[Path, str]:
        att, n = w["attention_dies"], w["attention_dies"] + w["expert_dies"]
        pt = Point(n, w["batch"], w["hidden"], w["topk"], w["experts"], 0, attention_dies=att)
        name = f"a2e-{w['quant']}-{att}+{w['expert_dies']}-b{w['batch']}-synthesized"

        def make(path: Path) -> dict:
            from bench.project.synth_a2e import config_for, synthesize_a2e

            synthesize_a2e(config_for(pt, w["quant"]), pt, w["quant"], path)
            return {}

        return self.get(name, w, make), "synthesized"

    def p2p(self, nbytes: int, lanes: int, w: dict) -> Path:
        cfg = PodConfig(num_dies=2, ring_slots=w["ring_slots"], slot_bytes=w["slot_bytes"])
        spec = {"bytes": nbytes, "lanes": lanes, "variant": w["variant"], "nodes": 2,
                "ring_slots": w["ring_slots"], "slot_bytes": w["slot_bytes"]}  # fmt: skip
        name = f"p2p-{w['variant']}-{nbytes}B-{lanes}lanes-{w['ring_slots']}x{w['slot_bytes']}"

        def make(path: Path) -> dict:
            return capture_p2p(cfg, nbytes, lanes, w["variant"], path, inter_node=True)[1]

        return self.get(name, spec, make)

    def write(self, nbytes: int) -> Path:
        """000 Table 1's figure: one write of `nbytes` into a die on another node and the flag
        after it, from the writer's start to the reader seeing the flag: one call that starts
        on both dies at once (a later call would start on the reader only once it saw the
        earlier one, after the next write had landed), so no warm-up call."""

        def make(path: Path) -> dict:
            d0 = [_write_event(k, 0, nbytes) for k in ("begin", "put", "pub", "end")]
            d1 = [_write_event(k, 0, nbytes) for k in ("begin", "acq", "end")]
            pattern = "die 0 writes die 1 on another node, then a flag; one call"
            workload = {"bench": "write", "bytes": nbytes, "pattern": pattern}
            meta = {"layout_version": LAYOUT_VERSION, "calls": ["write"], "warmup": 0,
                    "synthesized": True, "nodes": [0, 1], "workload": workload}  # fmt: skip
            dies = [{"die": 0, "streams": ["main"], "events": d0},
                    {"die": 1, "streams": ["main"], "events": d1}]  # fmt: skip
            write_trace_dir(path, meta, dies)
            return {}

        return self.get(f"write-{nbytes}B", {"bytes": nbytes, "calls": 1}, make)


def _write_event(kind: str, call: int, nbytes: int) -> list:
    if kind == "begin":
        return ["begin", 0, 0, 0, "write", call]
    if kind == "end":
        return ["end", 0, 0, 0, "write", call, []]
    if kind == "put":
        return ["put", 0, 0, 0, 1, nbytes, "app", 0, 0, 0]
    if kind == "pub":
        return ["pub", 0, 0, 0, 1, [WRITE_WORD], [call + 1]]
    return ["acq", 0, 0, 0, [WRITE_WORD], [call + 1], [0], "write"]


class Projector:
    """Replays each capture once on the profile (a point reads its figures from the Result)."""

    def __init__(self, profile: Profile):
        self.profile = profile
        self._done: dict[Path, Result] = {}

    def __call__(self, path: Path) -> Result:
        res = self._done.get(path)
        if res is None:
            res = self._done[path] = replay(load_capture(path, LAYOUT_VERSION), self.profile)
        return res


def project_point(p: PubPoint, caps: Captures, proj: Projector) -> tuple[float, str, dict]:
    """(projected figure, capture kind, details) of point `p`."""
    w = p.workload
    kind = w["kind"]
    if kind == "alltoall":
        path, how = caps.alltoall(w)
        return proj(path).calls(p.op).p50_us, how, {"capture_dir": path.name}
    if kind == "a2e":
        path, how = caps.a2e(w)
        return proj(path).calls(p.op).p50_us, how, {"capture_dir": path.name}
    if kind == "write":
        return proj(caps.write(w["bytes"])).calls("write").p50_us, "hand-built", {}
    if kind == "p2p_sizes":
        per = {n: proj(caps.p2p(n, w["lanes"], w)).calls("send").p50_us for n in w["sizes"]}
        worst = max(per, key=lambda n: per[n])
        return per[worst], "real", {"per_size_us": {str(n): round(v, 4) for n, v in per.items()},
                                    "slowest_bytes": worst}  # fmt: skip
    if kind == "p2p_ratio":
        a, b = (proj(caps.p2p(w["bytes"], lanes, w)).calls("send").p50_us for lanes in w["lanes"])
        return a / b, "real", {f"lanes_{w['lanes'][0]}_us": round(a, 4),
                               f"lanes_{w['lanes'][1]}_us": round(b, 4)}  # fmt: skip
    raise ValueError(f"point {p.id}: unknown workload kind {kind!r}")


def validate(profile: Profile, caps: Captures, only: list[PubPoint] | None = None) -> dict:
    """Project every point of `profile` (or `only`); the validation document (module doc)."""
    pts = only if only is not None else points_of(profile.name)
    proj = Projector(profile)
    rows = []
    for p in pts:
        got, how, details = project_point(p, caps, proj)
        error, ok = judge(p, got)
        us = p.unit == "us"
        rows.append({
            "id": p.id, "figure": p.figure, "op": p.op, "ep": p.ep, "batch": p.batch,
            "published": p.published, "projected": round(got, 4), "unit": p.unit,
            "published_us": p.published if us else None,
            "projected_us": round(got, 4) if us else None,
            "error": round(error, 4), "kind": p.kind, "tolerance": p.tolerance,
            "role": p.role, "ok": ok, "capture": how, "source": p.source, **details,
        })  # fmt: skip
    return {
        "profile": profile.name,
        "profile_sha256": profile.sha256,
        "frozen_sha256": FROZEN.get(profile.name),
        "frozen": FROZEN.get(profile.name) == profile.sha256,
        "calibrated_keys": calibrated_keys(profile),
        "points": rows,
        "summary": summary(rows),
        "captures": caps.made,
    }


def calibrated_keys(profile: Profile) -> dict:
    """name -> {value, points} of each calibrated constant of `profile`."""
    return {k: dict(v) for k, v in sorted(profile.calibrated.items())}


def summary(rows: list[dict]) -> dict:
    """Per role: points, within their bar, and the largest |error| of the value points."""
    out = {}
    for role in ("calibration", "held_out"):
        rs = [r for r in rows if r["role"] == role]
        vals = [abs(r["error"]) for r in rs if r["kind"] == "value" and r["error"] is not None]
        out[role] = {"points": len(rs), "ok": sum(r["ok"] for r in rs),
                     "max_abs_error": round(max(vals), 4) if vals else None}  # fmt: skip
    return out


def print_report(doc: dict) -> None:
    """The rows as a table, every projected figure labeled with its profile."""
    label = f"projected ({doc['profile']})"
    print(f"{'figure':<12} {'op':<32} {'ep':>4} {'batch':>5} {'published':>10} "
          f"{'projected':>10} {'error':>8} {'role':<11} {'capture':<11} ok")  # fmt: skip
    for r in doc["points"]:
        unit = {"us": " us", "ms": " ms", "%": " % "}.get(r["unit"], " x ")
        bound = {"below": "<", "at_least": ">="}.get(r["kind"], "")
        pub = f"{bound}{r['published']:g}{unit}"
        ep = "" if r["ep"] is None else r["ep"]
        batch = "" if r["batch"] is None else r["batch"]
        if r["projected"] is None:  # a point the projection refused (the reason, not a figure)
            print(f"{r['figure']:<12} {r['op']:<32} {ep:>4} {batch:>5} {pub:>10} "
                  f"{'refused':>10} {'':>8} {r['role']:<11} {r['capture']:<11} MISS"
                  f"  {r.get('refused', '')}")  # fmt: skip
            continue
        err = f"{r['error']:>+7.1f}p" if r["kind"] == "points" else f"{r['error']:>+8.1%}"
        prec = 3 if r["unit"] in ("ms", "x") else 1
        print(f"{r['figure']:<12} {r['op']:<32} {ep:>4} {batch:>5} {pub:>10} "
              f"{r['projected']:>7.{prec}f}{unit} {err} {r['role']:<11} "
              f"{r['capture']:<11} {'ok' if r['ok'] else 'MISS'}  {label}")  # fmt: skip
    for role, s in doc["summary"].items():
        worst = "" if s["max_abs_error"] is None else f", largest |error| {s['max_abs_error']:.1%}"
        print(f"{role}: {s['ok']} of {s['points']} within their bar{worst}")
    keys = ", ".join(f"{k} = {v['value']:g}" for k, v in doc["calibrated_keys"].items())
    print(f"calibrated: {keys or 'none'}")
    state = "frozen" if doc["frozen"] else (
        f"NOT the frozen profile ({doc['frozen_sha256'] or 'none recorded'}): held-out rows"
        " are not held out for it")  # fmt: skip
    print(f"profile {doc['profile']} sha256 {doc['profile_sha256']} ({state})")


def scratch_root(captures: str | None) -> tuple[Path, bool]:
    """The captures' root: `captures` (kept) or a temporary directory (removed after)."""
    if captures:
        root = Path(captures)
        root.mkdir(parents=True, exist_ok=True)
        return root, False
    return Path(tempfile.mkdtemp(prefix="xpod-validate-")), True


__all__ = ["Captures", "Projector", "a2a_config", "calibrated_keys", "print_report",
           "project_point", "scratch_root", "summary", "validate"]  # fmt: skip
