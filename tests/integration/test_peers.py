"""Peer baselines of `xpod bench p2p` (bench/peers.py, bench/mpi_peer.py) and the p2p plot.

Smoke tests only: rows come back well formed and nothing is left behind. Speed is never asserted.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import tempfile

import pytest

from bench.peers import PEER_TRANSPORTS, mpi_available, run_peer

SIZES = [8, 4096, 1 << 20]
ITERS_SCALE = 0.02  # 40 iterations for small sizes, the minimum of 5 at 1 MiB
ROW_KEYS = ("bench", "transport", "variant", "cores", "size_bytes")
ROW_KEYS += ("p50_us", "p99_us", "min_us", "gbps", "cpu_s_per_die")


def _child_pids() -> list[int]:
    """Pids whose parent is this process, zombies included, read from /proc."""
    me, found = os.getpid(), []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat", encoding="utf-8", errors="replace") as f:
                ppid = int(f.read().rsplit(")", 1)[1].split()[1])
        except (OSError, IndexError, ValueError):
            continue
        if ppid == me:
            found.append(int(entry))
    return found


def _peer_leftovers() -> set[str]:
    """shm-floor segments in /dev/shm and zmq-ipc socket directories in the temp dir."""
    found = {f"/dev/shm/{n}" for n in os.listdir("/dev/shm") if n.startswith("xpod-peer")}
    tmp = tempfile.gettempdir()
    return found | {f"{tmp}/{n}" for n in os.listdir(tmp) if n.startswith("xpod-peer")}


@pytest.fixture(autouse=True)
def nothing_left_behind():
    """Fail the test if it leaves a child process, a segment or a socket directory behind."""
    children_before, leftovers_before = set(_child_pids()), _peer_leftovers()
    yield
    assert mp.active_children() == []
    assert sorted(set(_child_pids()) - children_before) == []
    assert sorted(_peer_leftovers() - leftovers_before) == []


def _check_rows(rows: list[dict], transport: str) -> None:
    assert [r["size_bytes"] for r in rows] == SIZES
    for r in rows:
        missing = [k for k in ROW_KEYS if k not in r]
        assert not missing, f"{transport} row lacks {missing}: {r}"
        assert (r["bench"], r["transport"], r["variant"], r["cores"]) == ("p2p", transport, "", 1)
        assert r["p50_us"] > 0, r
        assert r["min_us"] <= r["p50_us"] <= r["p99_us"], r
        assert r["gbps"] > 0, r
        assert r["cpu_s_per_die"] >= 0, r


@pytest.mark.timeout(120)
@pytest.mark.parametrize("transport", ["shm-floor", "zmq-ipc", "pipe"])
def test_forked_peer_rows(transport):
    _check_rows(run_peer(transport, SIZES, iters_scale=ITERS_SCALE, timeout_s=100), transport)


@pytest.mark.timeout(120)
def test_mpi4py_peer_rows():
    ok, reason = mpi_available()
    if not ok:
        pytest.skip(reason)
    _check_rows(run_peer("mpi4py", SIZES, iters_scale=ITERS_SCALE, timeout_s=100), "mpi4py")


@pytest.mark.timeout(120)
def test_unpinned_peer_runs():
    rows = run_peer("shm-floor", [8], iters_scale=ITERS_SCALE, pin=False, timeout_s=100)
    assert len(rows) == 1 and rows[0]["p50_us"] > 0


@pytest.mark.timeout(120)
def test_timeout_kills_both_sides():
    # 30,000 round trips of 64 MiB (4 TB): no machine moves them in 0.5 s
    with pytest.raises(RuntimeError, match="pipe: no result after 0.5 s"):
        run_peer("pipe", [64 << 20], iters_scale=1000.0, timeout_s=0.5)


@pytest.mark.timeout(120)
@pytest.mark.parametrize(
    "transport, sizes, iters_scale",
    [("tcp", [8], 1.0), ("shm-floor", [], 1.0), ("pipe", [0], 1.0), ("pipe", [8], 0.0)],
)
def test_bad_arguments_raise_value_error(transport, sizes, iters_scale):
    with pytest.raises(ValueError):
        run_peer(transport, sizes, iters_scale=iters_scale)


def test_transport_names():
    assert PEER_TRANSPORTS == ("shm-floor", "zmq-ipc", "pipe", "mpi4py")


def _synthetic_rows() -> list[dict]:
    from bench.common import p2p_row

    rows = []
    for transport, variant, us in (("shm-floor", "", 0.2), ("pipe", "", 30.0), ("xpod", "v1", 1)):
        for size in (8, 4096, 1 << 20, 64 << 20):
            samples_ns = [us * 1e3 + size / 20] * 10
            rows.append(p2p_row(transport, variant, 2, size, samples_ns, 0.1))
    return rows


@pytest.mark.timeout(120)
def test_plot_p2p_writes_png(tmp_path):
    pytest.importorskip("matplotlib")
    from bench.plot import plot_p2p, plot_rows

    path = tmp_path / "p2p.png"
    plot_p2p(_synthetic_rows(), str(path))
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert path.stat().st_size > 1000
    plot_rows(_synthetic_rows(), str(tmp_path / "again.png"))
    with pytest.raises(NotImplementedError):
        plot_rows([{"bench": "ring"}], str(tmp_path / "no.png"))


@pytest.mark.timeout(120)
@pytest.mark.parametrize("transport", ["shm-floor", "zmq-ipc", "pipe"])
def test_failing_side_raises_and_kills_the_other(transport, monkeypatch):
    from bench.peers import procs

    def pin_or_fail(side: int) -> None:
        if side == 1:
            raise OSError("sched_setaffinity: injected failure")

    # Forked children inherit the patch; side 0 is then left waiting for an answer forever.
    monkeypatch.setattr(procs, "pin_to_core", pin_or_fail)
    with pytest.raises(RuntimeError, match="side 1 failed: OSError: sched_setaffinity: injected"):
        run_peer(transport, [8], iters_scale=ITERS_SCALE, pin=True, timeout_s=100)
