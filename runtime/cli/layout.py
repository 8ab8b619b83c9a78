"""`xpod layout`: print the region layout of a configuration (nothing is launched)."""

from __future__ import annotations

import argparse

from runtime.cli.flags import add_pod_flags, pod_config
from runtime.pod import PodConfig


def add_args(p: argparse.ArgumentParser) -> None:
    add_pod_flags(p)


def parse_options(args: argparse.Namespace) -> PodConfig:
    return pod_config(args)


def run(cfg: PodConfig) -> int:
    print(cfg.layout().describe())
    total = cfg.layout().region_bytes * cfg.num_dies
    print(f"pod total: {cfg.num_dies} regions, {total / 2**20:.1f} MiB")
    return 0
