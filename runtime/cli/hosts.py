"""The `--hosts` / `--fabric` / `--net-if` flags of every command that launches a pod over
several hosts (`xpod run`, `decode`, `generate`, `serve`; `bench p2p` has its own spelling).

`--hosts 2,2` emulates two hosts of two dies on this machine; `--hosts nodeA:8,nodeB:8` names
real hosts for mpirun. The dies are the sum. `--fabric mpi` (default) reaches other hosts'
dies over MPI (store messages + one-sided RMA), `mpi-rma` over one-sided RMA only, `mirror`
through poisoned mirrors of shared memory (one machine, no MPI: a protocol test).
"""

from __future__ import annotations

import argparse

from comm.fabric import host_names_of, hosts_of
from memory.errors import ConfigError

FABRICS = ("mpi", "mpi-rma", "mirror")


def hosts_spec(text: str) -> tuple[str, list[int]]:
    """argparse type of --hosts: (the spec, the host of every die)."""
    try:
        host_names_of(text)
        return text, hosts_of(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e).removeprefix("--hosts ")) from None


def add_host_args(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--hosts",
        type=hosts_spec,
        default=None,
        metavar="SPEC",
        help="dies per host: counts (2,2: emulated hosts on this machine) or names"
        " (nodeA:8,nodeB:8: mpirun's hosts); the dies are the sum",
    )
    p.add_argument(
        "--fabric",
        choices=FABRICS,
        default=None,
        help="with --hosts, how dies reach other hosts: mpi (default: MPI store messages and"
        " RMA), mpi-rma (one-sided only) or mirror (poisoned mirrors on one machine, no MPI)",
    )
    p.add_argument(
        "--net-if",
        default=None,
        metavar="IF",
        help="interface or CIDR between hosts (MPI's TCP, the control plane; default lo)."
        " MPI's TCP is unauthenticated: name a private network",
    )


def host_fields(args: argparse.Namespace, dies: int | None, default_dies: int | None = None):
    """(dies, PodConfig fields) of the parsed host flags: `dies` must be `default_dies` (not
    given) or the spec's sum."""
    out: dict = {}
    hosts = getattr(args, "hosts", None)
    fabric = getattr(args, "fabric", None)
    if hosts is not None:
        spec, per_die = hosts
        if dies not in (None, default_dies, len(per_die)):
            raise ConfigError(f"--dies {dies}: --hosts {spec} makes {len(per_die)} dies")
        dies = len(per_die)
        out.update(hosts=tuple(per_die), fabric=fabric or "mpi")
        names = host_names_of(spec)
        if names:
            out["host_names"] = tuple(names)
    elif fabric is not None:
        raise ConfigError(f"--fabric {fabric}: only with --hosts")
    if getattr(args, "net_if", None):
        out["net_if"] = args.net_if
    return dies, out
