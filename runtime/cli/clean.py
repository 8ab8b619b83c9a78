"""`xpod clean`: remove the segments of pods whose launcher is gone (never a live pod's).

`--pod ID` limits it to one pod: a multi-host pod's launcher runs `xpod clean --pod ID` on every
host after a crash (a host whose dies all died has nobody left to clean it).
"""

from __future__ import annotations

import argparse
import re


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--dry-run", action="store_true", help="list what would be removed")
    p.add_argument("--pod", type=pod_id, default=None, metavar="ID", help="only this pod's")


def pod_id(text: str) -> str:
    """argparse type of --pod: a pod id (hex digits, as in /dev/shm/xpod.<id>.*)."""
    if not re.fullmatch(r"[0-9a-f]+", text):
        raise argparse.ArgumentTypeError(f"{text!r} is not a pod id (hex digits)")
    return text


def parse_options(args: argparse.Namespace) -> tuple[bool, str | None]:
    return bool(args.dry_run), args.pod


def run(opts: tuple[bool, str | None]) -> int:
    from runtime.pod import control

    dry_run, pod = opts
    removed = control.clean(dry_run=dry_run, pod_id=pod)
    verb = "would remove" if dry_run else "removed"
    for name in removed:
        print(f"{verb} /dev/shm/{name}")
    live = [p for p, names in control.list_pods().items() if any(n.endswith(".ctl") for n in names)]
    if pod is not None:
        live = [p for p in live if p == pod]
    print(f"{verb} {len(removed)} segment(s); {len(live)} live pod(s) left alone")
    return 0
