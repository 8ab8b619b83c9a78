"""`xpod clean`: remove the segments of pods whose launcher is gone (never a live pod's)."""

from __future__ import annotations

import argparse


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--dry-run", action="store_true", help="list what would be removed")


def parse_options(args: argparse.Namespace) -> bool:
    return bool(args.dry_run)


def run(dry_run: bool) -> int:
    from runtime.pod import control

    removed = control.clean(dry_run=dry_run)
    verb = "would remove" if dry_run else "removed"
    for name in removed:
        print(f"{verb} /dev/shm/{name}")
    live = [p for p, names in control.list_pods().items() if any(n.endswith(".ctl") for n in names)]
    print(f"{verb} {len(removed)} segment(s); {len(live)} live pod(s) left alone")
    return 0
