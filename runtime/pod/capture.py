"""A capture pod's output (docs/projection.md §1.1): each die writes its own event log, then the
launcher writes `meta.json` LAST, so a directory with a meta is a whole capture."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

from memory import layout as L
from memory.errors import ConfigError

FORMAT, VERSION = "xpod-capture", 1


def dump_die(die, directory: str) -> dict:
    """Run on every die of a capture pod: write its log into `directory`; its meta entry."""
    cap = die.cap
    if cap is None:
        raise ConfigError(f"die {die.die_id}: not a capture pod (PodConfig.capture)")
    return cap.write(directory)


def write_capture(pod, directory: str | os.PathLike, workload: dict, calls: list[str],
                  warmup: int = 0, nodes: list[int] | None = None) -> Path:  # fmt: skip
    """Write the capture of everything `pod` (a capture pod) ran so far into `directory`
    (made if needed; an earlier capture there is replaced); returns its path.

    Arguments:
        pod: a running `Pod` launched with `PodConfig(capture=True)`.
        workload: what ran (docs/projection.md §1.1), stored as given.
        calls: the call names a projection reports (e.g. ["dispatch", "combine"]).
        warmup: calls of each name to leave out of the reported percentiles.
        nodes: the node of each die the workload places them on (default: the profile's
            die // dies_per_node).
    """
    if not pod.config.capture:
        raise ConfigError("write_capture: the pod is not a capture pod (PodConfig.capture)")
    out = Path(directory)
    out.mkdir(parents=True, exist_ok=True)
    meta_path = out / "meta.json"
    meta_path.unlink(missing_ok=True)  # an old capture is incomplete from here on
    for old in out.glob("die-*.msgpack"):
        old.unlink()
    dies = pod.run(dump_die, str(out))
    meta = {
        "format": FORMAT, "version": VERSION, "layout_version": L.LAYOUT_VERSION,
        "num_dies": pod.config.num_dies, "dies": sorted(dies, key=lambda d: d["die"]),
        "config": pod.config.to_dict(), "workload": workload, "calls": list(calls),
        "warmup": int(warmup), "synthesized": False, "commit": _commit(),
    }  # fmt: skip
    if nodes is not None:
        meta["nodes"] = [int(x) for x in nodes]
    tmp = out / ".meta.json.tmp"
    tmp.write_text(json.dumps(meta, indent=1, sort_keys=True), encoding="utf-8")
    os.replace(tmp, meta_path)
    return out


def _commit() -> str:
    """The checkout's git commit, or "" (an installed copy)."""
    here = Path(__file__).resolve().parent
    try:
        r = subprocess.run(["git", "-C", str(here), "rev-parse", "HEAD"], capture_output=True,
                           text=True, timeout=5, check=False)  # fmt: skip
    except OSError:
        return ""
    return r.stdout.strip() if r.returncode == 0 else ""
