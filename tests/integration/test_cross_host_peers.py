"""Cross-host peers of `xpod bench p2p --hosts 1,1 --peers` (bench/peers/tcp.py, bench/rma_peer.py).

Smoke tests only: every transport's rows come back well formed and nothing is left behind. Speed
is never asserted.
"""

from __future__ import annotations

import multiprocessing as mp
import os

import pytest

from bench.peers import mpi_available
from bench.peers.tcp import CROSS_HOST_TRANSPORTS, run_cross_host_peers

SIZES = [8, 65536]
ITERS_SCALE = 0.05  # 100 iterations at 8 B, 30 at 64 KiB
ROW_KEYS = ("bench", "transport", "variant", "cores", "size_bytes", "timing")
ROW_KEYS += ("p50_us", "p99_us", "min_us", "mean_us", "gbps", "cpu_s_per_die")


def _descendants() -> list[int]:
    """Pids of every process below this one, zombies included, read from /proc."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat", encoding="utf-8", errors="replace") as f:
                ppid = int(f.read().rsplit(")", 1)[1].split()[1])
        except (OSError, IndexError, ValueError):
            continue
        children.setdefault(ppid, []).append(int(entry))
    found, todo = [], [os.getpid()]
    while todo:
        for child in children.get(todo.pop(), []):
            found.append(child)
            todo.append(child)
    return found


def _mpi_leftovers() -> set[str]:
    """Open MPI backing directories `bench.peers.mpi` creates in /dev/shm."""
    return {n for n in os.listdir("/dev/shm") if n.startswith("xpod-mpi.")}


@pytest.fixture(autouse=True)
def nothing_left_behind():
    """Fail the test if it leaves a process (mpirun, a rank, a zmq side) or a directory behind."""
    before, leftovers_before = set(_descendants()), _mpi_leftovers()
    yield
    assert mp.active_children() == []
    assert sorted(set(_descendants()) - before) == []
    assert sorted(_mpi_leftovers() - leftovers_before) == []


@pytest.mark.timeout(120)
def test_every_transport_gives_sane_rows():
    ok, reason = mpi_available()
    if not ok:
        pytest.skip(reason)
    rows = run_cross_host_peers(SIZES, ITERS_SCALE, timeout_s=100)
    assert [(r["transport"], r["size_bytes"]) for r in rows] == [
        (t, s) for t in CROSS_HOST_TRANSPORTS for s in SIZES
    ]
    for r in rows:
        missing = [k for k in ROW_KEYS if k not in r]
        assert not missing, f"{r['transport']} row lacks {missing}: {r}"
        assert (r["bench"], r["variant"], r["cores"]) == ("p2p", "", 1), r
        assert (r["hosts"], r["cross_host"], r["net_if"]) == ("1,1", True, "lo"), r
        assert 0 < r["min_us"] <= r["p50_us"] <= r["p99_us"], r
        assert r["gbps"] > 0, r
        assert r["cpu_s_per_die"] >= 0, r
        want = "send+ack cycle" if r["transport"] == "rma-raw" else "round_trip/2"
        assert r["timing"] == want, r


@pytest.mark.timeout(120)
def test_zmq_tcp_alone_needs_no_mpi():
    rows = run_cross_host_peers([8], ITERS_SCALE, timeout_s=100, transports=["zmq-tcp"])
    assert len(rows) == 1 and rows[0]["transport"] == "zmq-tcp" and rows[0]["p50_us"] > 0


@pytest.mark.timeout(120)
@pytest.mark.parametrize(
    "kwargs",
    [
        {"transports": ["mpi4py-tcp", "tcp"]},
        {"transports": []},
        {"transports": ["zmq-tcp", "zmq-tcp"]},
        {"sizes": [0]},
        {"sizes": []},
        {"iters_scale": 0.0},
        {"net_if": "no-such-if0", "transports": ["zmq-tcp"]},
    ],
)
def test_bad_arguments_raise_value_error(kwargs):
    args = {"sizes": [8], "iters_scale": ITERS_SCALE, "timeout_s": 10} | kwargs
    with pytest.raises(ValueError):
        run_cross_host_peers(**args)


@pytest.mark.timeout(120)
def test_missing_mpirun_names_the_extra(monkeypatch):
    from bench.peers import tcp

    monkeypatch.setattr(tcp, "mpirun", lambda: None)
    with pytest.raises(RuntimeError, match=r"pip install -e '\.\[multihost\]'"):
        run_cross_host_peers([8], ITERS_SCALE, timeout_s=10, transports=["rma-raw"])


@pytest.mark.timeout(120)
def test_timeout_kills_every_rank():
    ok, reason = mpi_available()
    if not ok:
        pytest.skip(reason)
    # 30,000 round trips of 64 MiB over TCP (4 TB): no machine moves them in 1 s
    with pytest.raises(RuntimeError, match="no result after 1"):
        run_cross_host_peers([64 << 20], 1000.0, timeout_s=1.0, transports=["rma-pingpong"])
