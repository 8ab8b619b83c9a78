"""Pods over several hosts on MPI-4 RMA (`runtime.pod.mpi_launch`, `comm.fabric_mpi`).

Two emulated hosts on this machine (`hosts=(0, 0, 1, 1)`, `fabric="mpi"`): the dies are
mpirun's ranks, dies 2 and 3 reach dies 0 and 1 (and back) only through MPI windows. The
default part shares one pod (launching one costs ~3 s on 2 cores); the crash tests launch
their own and are slow. Every test leaves no process and no /dev/shm segment behind (the
autouse leak check of tests/conftest.py, plus explicit checks of the pod's segments).
"""

from __future__ import annotations

import contextlib
import os
import signal
import statistics
import threading
import time

import numpy as np
import pytest

import comm
from memory.errors import PodError
from runtime.pod import DieCrashed, PodConfig
from runtime.pod import control as C
from runtime.pod.launcher import Pod

pytest.importorskip("mpi4py")
pytestmark = pytest.mark.multihost

HOSTS = (0, 0, 1, 1)
CFG = dict(hosts=HOSTS, fabric="mpi")
OFF = 1 << 20  # app-area offset of the payload tests
SLOT = 256  # bytes per source die


@pytest.fixture(scope="module")
def shared(shared_pod_factory):
    return shared_pod_factory(**CFG)


@pytest.fixture
def pod(shared, shared_pod_guard):
    return shared_pod_guard(shared)


def _left(pod_id: str) -> list[str]:
    return C.list_pods().get(pod_id, [])


# -- functions run on the dies ---------------------------------------------------------------------


def where(die):
    fab = die.fab
    remote = [d for d in range(die.num_dies) if fab.remote[d]]
    return die.die_id, fab.hosts[die.die_id], os.getpid(), fab.kind, remote


def push_publish_pull(die):
    """Every die writes a payload naming itself into every peer's app area (push), a guard
    word after it (publish), then checks what landed in its own region, then pulls every
    peer's payload to itself back."""
    me, n, fab = die.die_id, die.num_dies, die.fab
    base = die.layout.app_off + OFF
    guard = (base + n * SLOT) // 8  # one word per source after the payloads
    comm.barrier(die)
    for peer in range(n):
        if peer == me:
            continue
        off = base + me * SLOT
        payload = np.full(SLOT, 16 * me + peer, np.uint8)
        fab.bytes[peer][off : off + SLOT] = payload.tobytes()
        fab.push(peer, off, SLOT)
        fab.publish(peer, guard + me, 1000 + me)
    comm.barrier(die)
    own = die.region.array
    seen = {}
    for src in range(n):
        if src != me:
            got = own[base + src * SLOT : base + (src + 1) * SLOT]
            seen[src] = (int(got.min()), int(got.max()), die.words[me][guard + src])
    # A pull reads the peer's memory as it is: the stores this die sent it have landed once
    # the peer has seen their guard, which every peer has once it left the barrier above
    # (a die leaves it after the guards of every die's earlier stores); a second barrier
    # makes sure every peer has left the first.
    comm.barrier(die)
    pulled = {}
    for peer in range(n):
        if peer != me:
            off = base + me * SLOT  # what this die pushed there
            fab.pull(peer, off, SLOT)
            view = np.frombuffer(fab.bytes[peer][off : off + SLOT], np.uint8)
            pulled[peer] = (int(view.min()), int(view.max()))
    comm.barrier(die)
    return seen, pulled


def fetch_add_storm(die, count: int):
    word = (die.layout.app_off + OFF) // 8
    if die.die_id == 0:
        die.words[0][word] = 0
    comm.barrier(die)
    olds = [die.fab.fetch_add(0, word, 1) for _ in range(count)]
    comm.barrier(die)
    return die.words[0][word] if die.die_id == 0 else None, olds


def busy_receiver(die, busy_s: float):
    """Die 2 computes `busy_s` of numpy without entering MPI while die 0 sends to it."""
    buf = die.alloc(4096)
    comm.barrier(die)
    if die.die_id == 0:
        buf[:] = 7
        comm.send(die, buf, 2, 1)
    elif die.die_id == 2:
        a = np.random.default_rng(0).random((200, 200))
        t0 = time.perf_counter()
        while time.perf_counter() - t0 < busy_s:
            a = a @ a
            a /= np.abs(a).max()
        comm.recv(die, buf, 0, 1)
        assert (buf == 7).all()
    comm.barrier(die)
    die.free(buf)
    return True


def publish_rtt(die, rounds: int):
    """Die 0 publishes 8 B to die 2 (other host), die 2 acks with a publish; round trips, µs."""
    word = (die.layout.app_off + OFF) // 8
    me, fab = die.die_id, die.fab
    own = die.words[me]
    comm.barrier(die)
    times = []
    if me in (0, 2):
        peer = 2 if me == 0 else 0
        for i in range(1, rounds + 1):
            t0 = time.perf_counter_ns()
            if me == 0:
                fab.publish(peer, word, i)
            die.wait_ge(own, word, i, peer, "rtt")
            if me == 2:
                fab.publish(peer, word, i)
            times.append((time.perf_counter_ns() - t0) / 1e3)
    comm.barrier(die)
    return times


def spin(die, seconds: float):
    """Barriers for `seconds` (the dies' pod.run outlasts the fault injected meanwhile)."""
    t0 = time.monotonic()
    while time.monotonic() - t0 < seconds:
        comm.barrier(die)
    return True


# -- the shared pod ---------------------------------------------------------------------------


@pytest.mark.timeout(60)
def test_dies_are_ranks_on_their_hosts(pod):
    res = pod.run(where)
    assert [r[0] for r in res] == [0, 1, 2, 3]
    assert [r[1] for r in res] == list(HOSTS)
    assert len({r[2] for r in res}) == 4 and os.getpid() not in {r[2] for r in res}
    assert {r[3] for r in res} == {"mpi"}
    assert [r[4] for r in res] == [[2, 3], [2, 3], [0, 1], [0, 1]]


@pytest.mark.timeout(60)
def test_push_publish_land_and_pull_reads_back(pod):
    for me, (seen, pulled) in enumerate(pod.run(push_publish_pull)):
        for src, (lo, hi, guard) in seen.items():
            assert lo == hi == 16 * src + me, f"die {me}: payload of die {src}"
            assert guard == 1000 + src
        for peer, (lo, hi) in pulled.items():
            assert lo == hi == 16 * me + peer, f"die {me}: pulled from die {peer}"


@pytest.mark.timeout(60)
def test_fetch_add_storm_through_the_window(pod):
    res = pod.run(fetch_add_storm, 200)
    assert res[0][0] == 800
    olds = sorted(o for _, oo in res for o in oo)
    assert olds == list(range(800))  # every add saw a distinct previous value


@pytest.mark.timeout(60)
def test_busy_target_does_not_time_out_its_sender(pod):
    assert pod.run(busy_receiver, 0.05) == [True] * 4


@pytest.mark.timeout(60)
def test_publish_ack_round_trip_between_hosts(pod):
    times = pod.run(publish_rtt, 200)[0]
    med = statistics.median(times)
    print(f"\nMpiFabric 8 B publish + ack round trip, hosts 0 <-> 1: median {med:.0f} us")
    assert med < 50_000


@pytest.mark.timeout(60)
def test_errors_come_back_with_their_die(pod):
    with pytest.raises(ZeroDivisionError) as ei:
        pod.run(_fail_on, 3)
    assert ei.value.die_id == 3
    assert pod.run(where)[3][0] == 3  # the pod is still usable


def _fail_on(die, who: int):
    if die.die_id == who:
        return 1 / 0
    return comm.barrier(die)


# -- launch and teardown -------------------------------------------------------------------------


@pytest.mark.timeout(60)
def test_clean_removes_a_leftover_host_control_segment():
    """A host leader's control segment whose dies are gone: `xpod clean --pod` removes it."""
    from runtime.cli.main import main

    pod_id = "f00d" + os.urandom(2).hex()
    ctl = C.Control.create(pod_id, 2, host_leader=True)
    try:
        ctl.words[C.W_PID] = ctl.words[C.W_DIE_PID] = 2**22 + 12345  # no such process
        ctl.words[C.W_START] = 1
        assert main(["clean", "--pod", pod_id]) == 0
        assert _left(pod_id) == []
    finally:
        ctl.close()
        ctl.unlink()


@pytest.mark.slow
@pytest.mark.timeout(60)
def test_a_die_that_cannot_start_is_a_clear_error():
    with pytest.raises(PodError, match="mpirun"):
        Pod.launch(PodConfig(num_dies=4, **CFG, net_if="xpod-no-such-if", ready_timeout_s=20))


def _crash(victims: list[int]):
    pod = Pod.launch(PodConfig(num_dies=4, **CFG, timeout_s=60.0, app_bytes=4 << 20))
    pids = [r[2] for r in pod.run(where)]
    killed_at = []

    def killer():
        time.sleep(0.5)
        killed_at.append(time.monotonic())
        for v in victims:
            os.kill(pids[v], signal.SIGKILL)

    t = threading.Thread(target=killer)
    t.start()
    try:
        with pytest.raises(DieCrashed) as ei:
            pod.run(spin, 40.0)
    finally:
        t.join()
        pod.close()
    latency = time.monotonic() - killed_at[0]
    return pod, ei.value, latency


@pytest.mark.slow
@pytest.mark.timeout(60)
@pytest.mark.parametrize(
    "victims",
    [[3], pytest.param([0], marks=pytest.mark.multihost), [2, 3]],
    ids=["die", "host-leader", "host"],
)
def test_a_killed_die_is_named(victims):
    pod, err, latency = _crash(victims)
    print(f"\nkill {victims} -> DieCrashed in {latency:.2f} s")  # the 2 s bar: bench faults
    assert err.dies == victims, str(err)
    assert latency < 30.0  # named by its crash, not by the 60 s deadline of its peers
    assert _left(pod.pod_id) == []


@pytest.mark.slow
@pytest.mark.timeout(60)
def test_a_stopped_die_is_hung():
    from runtime.pod import DieHung

    pod = Pod.launch(PodConfig(num_dies=4, **CFG, timeout_s=2.0, app_bytes=4 << 20))
    pid = pod.run(where)[1][2]
    try:
        os.kill(pid, signal.SIGSTOP)
        with pytest.raises(DieHung) as ei:
            pod.run(spin, 5.0)
        assert ei.value.die_id == 1
    finally:
        with contextlib.suppress(OSError):
            os.kill(pid, signal.SIGKILL)
        pod.close()
    assert _left(pod.pod_id) == []


LAUNCHER = """
import sys, time
from runtime.pod import Pod, PodConfig
pod = Pod.launch(PodConfig(num_dies=4, hosts=(0, 0, 1, 1), fabric="mpi", app_bytes=4 << 20))
print(pod.pod_id, pod.mpirun.pid, flush=True)
time.sleep(60)
"""


@pytest.mark.slow
@pytest.mark.timeout(60)
def test_dies_do_not_outlive_a_killed_launcher():
    import subprocess
    import sys

    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    p = subprocess.Popen([sys.executable, "-c", LAUNCHER], cwd=root, stdout=subprocess.PIPE)
    try:
        pod_id, mpirun = p.stdout.readline().decode().split()
        assert _left(pod_id)
        p.kill()
        p.wait()
        deadline = time.monotonic() + 10
        while (_left(pod_id) or _runs(int(mpirun))) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert _left(pod_id) == [] and not _runs(int(mpirun))
    finally:
        p.kill()
        p.wait()


def _runs(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] not in "ZX"
    except OSError:
        return False
