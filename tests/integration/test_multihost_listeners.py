"""The listening sockets of a pod over (emulated) hosts (docs/architecture.md §7).

While a `hosts=(0, 1)` MPI pod is up, every listening (or bound UDP) socket of mpirun's process
tree (prterun and the dies) is either bound to loopback, or is one Open MPI binds to every
address whatever its parameters (btl/tcp in the dies, PRRTE's oob/tcp in prterun) and the
launcher's one warning line names it, process and port. The classification itself (which
addresses `--net-if` allows, what a wildcard reaches) is checked on made-up interfaces.
"""

from __future__ import annotations

import ipaddress
import logging
import re
import socket

import psutil
import pytest

from memory.errors import PodError
from runtime.pod import PodConfig, die_mpi

pytest.importorskip("mpi4py")
pytestmark = pytest.mark.timeout(120)

WARNING = "MPI listens beyond --net-if"


def _endpoint(ip: str, port: int) -> str:
    return f"[{ip}]:{port}" if ":" in ip else f"{ip}:{port}"


def _tree_listeners(root_pid: int) -> tuple[list[tuple[int, str, int]], set[int]]:
    """((pid, address, port) of every listening TCP / bound UDP socket, pids) of the tree."""
    root = psutil.Process(root_pid)
    procs = [root, *root.children(recursive=True)]
    found = []
    for p in procs:
        for c in p.net_connections("inet"):
            if c.laddr and (c.status == psutil.CONN_LISTEN or c.type == socket.SOCK_DGRAM):
                found.append((p.pid, c.laddr.ip, c.laddr.port))
    return found, {p.pid for p in procs}


def _only_loopback_here() -> bool:
    """True inside a network namespace whose only interface is lo: a wildcard is loopback."""
    return all(
        ipaddress.ip_address(a.address.split("%")[0]).is_loopback
        for addrs in psutil.net_if_addrs().values()
        for a in addrs
        if a.family in (socket.AF_INET, socket.AF_INET6)
    )


def test_every_listener_is_loopback_or_named_in_the_warning(pod_factory, caplog):
    caplog.set_level(logging.WARNING, logger="runtime.pod.mpi_launch")
    pod = pod_factory(num_dies=2, hosts=(0, 1), fabric="mpi")
    found, pids = _tree_listeners(pod.mpirun.pid)
    assert set(pod.pids) <= pids, (pod.pids, pids)
    listening = {pid for pid, _, _ in found}
    assert listening >= {pod.mpirun.pid, *pod.pids}, found  # prterun and every die listen
    warned = [r.getMessage() for r in caplog.records if WARNING in r.getMessage()]
    assert len(warned) <= 1 and "\n" not in "".join(warned), warned
    names = {pod.mpirun.pid: "prterun"} | {p: f"die {r}" for r, p in enumerate(pod.pids)}
    named = _named(warned[0], set(names.values())) if warned else set()
    loopback_only = _only_loopback_here()
    for pid, ip, port in found:
        address = ipaddress.ip_address(ip)
        if address.is_loopback or (address.is_unspecified and loopback_only):
            continue
        who, ep = names.get(pid, f"pid {pid}"), _endpoint(ip, port)
        assert (who, ep) in named, f"{who} listens on {ep}: not loopback, not warned: {warned}"
    assert named == {(who, _endpoint(ip, port)) for who, ip, port in pod.exposed}
    if warned:
        assert "firewall rule or a network namespace" in warned[0], warned


def _named(warning: str, who: set[str]) -> set[tuple[str, str]]:
    """(process, endpoint) pairs of the warning's "die 0 0.0.0.0:1024 [::]:1024; ..." parts."""
    out = set()
    for part in re.split(r"; |: ", warning):
        name = next((w for w in who if part.startswith(w + " ")), None)
        if name is not None:
            out |= {(name, ep) for ep in part[len(name) :].split()}
    return out


MACHINE = {"lo": ["127.0.0.1", "::1"], "eth0": ["10.1.2.3", "fd00::2", "fe80::1"]}
SOCKETS = [("p", "127.0.0.1", 1), ("p", "::1", 2), ("p", "0.0.0.0", 3), ("p", "::", 4),
           ("p", "10.1.2.3", 5), ("p", "fd00::2", 6)]  # fmt: skip


@pytest.mark.parametrize(
    "net_if, machine, ports",
    [
        ("lo", MACHINE, [3, 4, 5, 6]),  # a wildcard reaches eth0
        ("", MACHINE, [3, 4, 5, 6]),  # the default is lo
        ("eth0", MACHINE, []),  # every address a wildcard reaches is eth0's or loopback
        ("10.1.2.0/24", MACHINE, [4, 6]),  # "::" also reaches eth0's IPv6 addresses
        ("fd00::/64", MACHINE, [3, 4, 5]),
        ("lo", {"lo": MACHINE["lo"]}, [5, 6]),  # lo only (a network namespace): wildcards too
    ],
)
def test_exposed_sockets_by_net_if(monkeypatch, net_if, machine, ports):
    monkeypatch.setattr(die_mpi, "local_addresses", lambda: machine)
    assert [port for _, _, port in die_mpi.exposed(SOCKETS, net_if)] == ports


def test_bind_address_takes_the_ipv4_address_of_net_if(monkeypatch):
    monkeypatch.setattr(die_mpi, "local_addresses", lambda: MACHINE)
    real = dict(num_dies=2, hosts=(0, 1), host_names=("a", "b"))
    assert die_mpi.bind_address(PodConfig(**real, net_if="eth0")) == "10.1.2.3"
    assert die_mpi.bind_address(PodConfig(**real, net_if="10.1.0.0/16")) == "10.1.2.3"
    assert die_mpi.bind_address(PodConfig(num_dies=2, hosts=(0, 1))) == "127.0.0.1"
    with pytest.raises(PodError, match="no IPv4 address"):
        die_mpi.bind_address(PodConfig(**real, net_if="fd00::/64"))
