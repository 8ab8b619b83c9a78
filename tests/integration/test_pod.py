"""The pod launcher: run / results / errors, bad configurations, crashes, signals, clean-up.

Tests that kill dies or launchers use their own pods; the others share one module pod.
"""

from __future__ import annotations

import json
import os
import signal
import stat
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import numpy as np
import pytest
from conftest import ours  # tests/conftest.py, as pytest imported it

import comm
from memory.alloc import AllocError
from runtime import (
    ConfigError,
    DieCrashed,
    PeerTimeout,
    Pod,
    PodAborted,
    PodConfig,
    PodError,
    ProtocolError,
)
from runtime.pod import control

ROOT = Path(__file__).resolve().parents[2]
SHM = Path("/dev/shm")
MiB = 1 << 20
# A deadline no test waits for when the mechanism under test works: a bound at half of it
# tells that mechanism from the deadline on any machine, fast or slow
LONG_S = 120.0


@pytest.fixture(scope="module")
def shared(shared_pod_factory):
    return shared_pod_factory(num_dies=4, timeout_s=10.0)


@pytest.fixture
def pod(shared, shared_pod_guard):
    return shared_pod_guard(shared)


# -- functions run on the dies (module level: pickled by reference) ------------------------------


def whoami(die, tag):
    return (die.die_id, die.num_dies, os.getpid(), tag)


def remember(die, value):
    die.user.setdefault("seen", []).append(value)
    return list(die.user["seen"])


class Boom(Exception):
    """A user exception type that must come back with its own type."""


def raise_on(die, bad_die, exc_name):
    if die.die_id == bad_die:
        exc = {"ValueError": ValueError, "Boom": Boom, "ProtocolError": ProtocolError}[exc_name]
        raise exc(f"boom from die {die.die_id}")
    return die.die_id


def raise_while_peer_waits(die):
    """Die 0 fails at once; die 1 waits in a recv from die 0 that never comes."""
    if die.die_id == 0:
        raise ValueError("die 0 gave up")
    if die.die_id == 1:
        comm.recv(die, np.zeros(4, np.int64), 0, 1)
    return die.die_id


def exchange_one(die, event_id):
    """Die 0 sends 8 int64 to die 1 (a check that the pair is still usable)."""
    data = np.arange(8, dtype=np.int64) + 1000 * die.die_id + event_id
    if die.die_id == 0:
        comm.send(die, data, 1, event_id)
        return None
    if die.die_id == 1:
        buf = np.zeros(8, np.int64)
        comm.recv(die, buf, 0, event_id)
        return buf.tolist()
    return None


def unpicklable_result(die):
    return lambda: None


class Unpicklable(Exception):
    def __init__(self):
        super().__init__("holds a generator")
        self.gen = (i for i in range(3))


def raise_unpicklable(die):
    if die.die_id == 1:
        raise Unpicklable()
    return die.die_id


def both_recv(die):
    """Dies 0 and 1 each wait for the other: a deadlock only an abort or timeout ends."""
    if die.die_id in (0, 1):
        comm.recv(die, np.zeros(4, np.int64), 1 - die.die_id, 5)
    return die.die_id


def recv_from_silent_peer(die):
    if die.die_id == 0:
        comm.recv(die, np.zeros(4, np.int64), 1, 3)
    return die.die_id


def sleep_then_barrier(die):
    time.sleep(0.05 * die.die_id)
    before = time.monotonic()
    die.barrier()
    return before, time.monotonic()


def kill_self_while_peer_waits(die):
    if die.die_id == 1:
        time.sleep(0.2)  # let die 0 get into its recv first
        os.kill(os.getpid(), signal.SIGKILL)
    if die.die_id == 0:
        comm.recv(die, np.zeros(16, np.int64), 1, 9)
    return die.die_id


def exit_hard(die):
    if die.die_id == 2:
        os._exit(3)
    time.sleep(0.1)
    return die.die_id


def alloc_in_die(die, nbytes):
    a = die.alloc(nbytes, np.uint8)
    off = die.allocator.region_offset(a)
    die.free(a)
    return off, die.layout.app_off, die.layout.app_bytes


def send_one_to_1(die, event_id):
    if die.die_id == 0:
        comm.send(die, np.arange(100, dtype=np.uint8), 1, event_id)
    elif die.die_id == 1:
        comm.recv(die, np.zeros(100, np.uint8), 0, event_id)
    return die.die_id


# -- launch / run / close -------------------------------------------------------------------------


@pytest.mark.timeout(60)
def test_launch_run_close(pod_factory):
    pod = pod_factory(num_dies=3)
    names = pod.segment_names()
    assert len(names) == 4 and all(n.startswith("/xpod." + pod.pod_id) for n in names)
    assert all((SHM / n.lstrip("/")).exists() for n in names)
    res = pod.run(whoami, "x")
    assert [r[0] for r in res] == [0, 1, 2]
    assert all(r[1] == 3 and r[3] == "x" for r in res)
    pids = [r[2] for r in res]
    assert pids == [p.pid for p in pod.procs]
    assert len(set(pids)) == 3 and os.getpid() not in pids
    pod.close()
    assert pod.closed
    assert not any((SHM / n.lstrip("/")).exists() for n in names)
    for pid in pids:
        assert not Path(f"/proc/{pid}").exists() or _zombie_or_gone(pid)
    pod.close()  # idempotent
    with pytest.raises(PodError, match="closed"):
        pod.run(whoami, "y")


def _zombie_or_gone(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().split(") ")[1][0] in "ZX"
    except OSError:
        return True


@pytest.mark.timeout(60)
def test_context_manager_closes():
    with Pod.launch(PodConfig(num_dies=2, app_bytes=MiB, timeout_s=5.0)) as pod:
        names = pod.segment_names()
        assert pod.run(whoami, 1)[1][0] == 1
    assert pod.closed
    assert not any((SHM / n.lstrip("/")).exists() for n in names)


@pytest.mark.timeout(60)
def test_launch_overrides():
    with Pod.launch(PodConfig(app_bytes=MiB, timeout_s=5.0), num_dies=2, lanes=2) as pod:
        assert pod.config.num_dies == 2 and pod.config.lanes == 2
        assert len(pod.run(whoami, 0)) == 2


@pytest.mark.timeout(60)
def test_results_by_die_id_and_state_between_runs(pod):
    assert pod.run(whoami, "a") == [(r, 4, pod.procs[r].pid, "a") for r in range(4)]
    tag = f"t{time.monotonic_ns()}"
    first = pod.run(remember, tag)
    second = pod.run(remember, tag + "b")
    for r in range(4):
        assert second[r][-2:] == [tag, tag + "b"]
        assert first[r][-1] == tag


@pytest.mark.timeout(60)
def test_one_die_pod(pod_factory):
    pod = pod_factory(num_dies=1)
    assert pod.run(whoami, 7)[0][:2] == (0, 1)
    pod.run(sleep_then_barrier)  # a barrier of one returns at once


@pytest.mark.timeout(60)
def test_barrier_waits_for_every_die(pod):
    res = pod.run(sleep_then_barrier)
    last_entry = max(before for before, _ in res)
    assert all(after >= last_entry for _, after in res)


@pytest.mark.timeout(60)
def test_alloc_in_app_area(pod):
    for off, app_off, app_bytes in pod.run(alloc_in_die, 1000):
        assert app_off <= off and off + 1000 <= app_off + app_bytes


@pytest.mark.timeout(60)
def test_alloc_error_comes_back_with_die_id(pod):
    with pytest.raises(AllocError) as ei:
        pod.run(alloc_in_die, 64 * MiB)
    assert ei.value.die_id in range(4)
    assert pod.run(whoami, 0)[0][0] == 0


# -- errors from dies -----------------------------------------------------------------------------


@pytest.mark.timeout(60)
@pytest.mark.parametrize(
    "exc_name, exc_type", [("ValueError", ValueError), ("Boom", Boom), ("ProtocolError", PodError)]
)
def test_die_exception_reraised_with_type_die_id_and_remote_traceback(pod, exc_name, exc_type):
    with pytest.raises(exc_type) as ei:
        pod.run(raise_on, 2, exc_name)
    err = ei.value
    assert type(err).__name__ == exc_name
    assert err.die_id == 2
    assert "boom from die 2" in str(err)
    notes = "\n".join(getattr(err, "__notes__", []))
    assert "die 2" in notes and "Traceback" in notes and "raise_on" in notes
    # the pod is still usable, and the same pair still moves data
    assert [r[0] for r in pod.run(whoami, "after")] == [0, 1, 2, 3]
    assert pod.run(exchange_one, 11)[1] == (np.arange(8) + 11).tolist()


@pytest.mark.timeout(60)
def test_die_error_aborts_peers_waiting_on_it(pod_factory):
    pod = pod_factory(timeout_s=LONG_S)
    t0 = time.monotonic()
    with pytest.raises(ValueError, match="gave up") as ei:
        pod.run(raise_while_peer_waits)
    # die 1 would wait timeout_s for die 0; the launcher aborts it after a short grace
    assert time.monotonic() - t0 < LONG_S / 2
    assert ei.value.die_id == 0
    assert pod.run(exchange_one, 12)[1] == (np.arange(8) + 12).tolist()


@pytest.mark.timeout(60)
def test_unpicklable_result_is_a_type_error(pod):
    with pytest.raises(TypeError) as ei:
        pod.run(unpicklable_result)
    assert ei.value.die_id in range(4)
    assert len(pod.run(whoami, 0)) == 4


@pytest.mark.timeout(60)
def test_unpicklable_exception_still_reported(pod):
    with pytest.raises(Exception) as ei:
        pod.run(raise_unpicklable)
    assert "Unpicklable" in str(ei.value) or type(ei.value).__name__ == "Unpicklable"
    assert ei.value.die_id == 1
    assert len(pod.run(whoami, 0)) == 4


@pytest.mark.timeout(60)
def test_unpicklable_function_refused_in_the_launcher(pod):
    with pytest.raises(TypeError):
        pod.run(lambda die: 1)
    assert len(pod.run(whoami, 0)) == 4


@pytest.mark.timeout(60)
def test_run_timeout_aborts_the_dies(pod_factory):
    pod = pod_factory(timeout_s=LONG_S)
    t0 = time.monotonic()
    with pytest.raises(PodError) as ei:
        pod.run(both_recv, timeout_s=0.5)
    assert time.monotonic() - t0 < LONG_S / 2  # not the dies' own deadline
    assert isinstance(ei.value, PodAborted) or "0.5" in str(ei.value)
    assert pod.run(exchange_one, 13)[1] == (np.arange(8) + 13).tolist()


@pytest.mark.timeout(60)
def test_peer_timeout_names_die_peer_field(pod_factory):
    pod = pod_factory(num_dies=2, timeout_s=0.5)
    t0 = time.monotonic()
    with pytest.raises(PeerTimeout) as ei:
        pod.run(recv_from_silent_peer)
    assert time.monotonic() - t0 < 60 * 0.5  # the 0.5 s deadline, not another one
    msg = str(ei.value)
    assert ei.value.die_id == 0
    assert "die 0" in msg and "die 1" in msg and "desc.tail_ptr" in msg and "seen" in msg


@pytest.mark.timeout(60)
def test_mutual_wait_times_out_on_both_dies(pod_factory):
    pod = pod_factory(num_dies=2, timeout_s=0.5)
    t0 = time.monotonic()
    with pytest.raises(PeerTimeout):
        pod.run(both_recv)
    assert time.monotonic() - t0 < 60 * 0.5  # the 0.5 s deadline, not another one
    pod.close()


# -- fields can be decoded from the launcher -------------------------------------------------------


@pytest.mark.timeout(60)
def test_fields_decode_from_the_launcher(pod):
    desc0 = pod.region(1).field("desc", 0, 0).copy()
    ack0 = pod.region(0).field("ack", 1, 0).copy()
    pod.run(send_one_to_1, 77)
    desc = pod.region(1).field("desc", 0, 0)
    ack = pod.region(0).field("ack", 1, 0)
    assert int(desc["event_id"]) == 77
    assert int(desc["tail_ptr"]) == int(desc0["tail_ptr"]) + 1
    assert int(ack["event_id"]) == 77 and int(ack["status"]) == 0
    assert int(ack["head_ptr"]) == int(ack0["head_ptr"]) + 1
    assert int(ack["done"]) == int(ack0["done"]) + 1  # the message sequence number
    assert int(desc["msg_info"]) & ((1 << 40) - 1) == 100
    assert pod.region(2).fields("desc").shape == (4, pod.config.lanes)


# -- configuration errors come before any process or segment ---------------------------------------


def _snapshot():
    """(this process's xpod segments, its child processes): pods other processes run on the
    machine meanwhile (another test run, a benchmark) are not ours to count."""
    return {e for e in os.listdir(SHM) if e.startswith("xpod.") and ours(e)}, _children()


def _children():
    me = os.getpid()
    kids = set()
    for e in os.listdir("/proc"):
        if e.isdigit():
            try:
                stat_ = Path(f"/proc/{e}/stat").read_text()
            except OSError:
                continue
            if int(stat_.rsplit(")", 1)[1].split()[1]) == me:
                kids.add(int(e))
    return kids


@pytest.mark.timeout(60)
@pytest.mark.parametrize(
    "build, field",
    [
        (lambda: Pod.launch(PodConfig(num_dies=0)), "num_dies"),
        (lambda: Pod.launch(PodConfig(), num_dies=0), "num_dies"),
        (lambda: Pod.launch(PodConfig(lanes=0)), "lanes"),
        (lambda: Pod.launch(PodConfig(slot_bytes=100)), "slot_bytes"),
        (lambda: Pod.launch(PodConfig(timeout_s=0)), "timeout_s"),
        (lambda: Pod.launch(PodConfig.load(foo=1)), "foo"),
        (lambda: Pod.launch(PodConfig.from_dict({"num_dies": 2, "bogus_key": 3})), "bogus_key"),
        (lambda: Pod.launch(PodConfig(), bogus_key=3), "bogus_key"),
        (lambda: Pod.launch(PodConfig(app_bytes=8 * MiB, max_region_bytes=MiB)),
         "max_region_bytes"),
        (lambda: Pod.launch(PodConfig(num_dies=2, app_bytes=MiB), max_region_bytes=64 * 1024),
         "max_region_bytes"),
    ],
    ids=["num_dies", "num_dies-override", "lanes", "slot_bytes", "timeout_s", "unknown-load",
         "unknown-dict", "unknown-override", "region-too-small", "region-too-small-override"],
)  # fmt: skip
def test_bad_config_fails_before_anything_starts(build, field):
    segs, kids = _snapshot()
    with pytest.raises(ConfigError) as ei:
        build()
    assert field in str(ei.value)
    assert _snapshot() == (segs, kids)


# -- start-up failures ----------------------------------------------------------------------------


def _startup_hook(action: str, bad_die: int):
    """A stand-in for the die's first start-up step (runtime.pod.die.pin_die), run in every die."""

    def hook(die_id, config):
        if die_id != bad_die:
            return
        if action == "raise":
            raise RuntimeError(f"die {die_id} cannot start")
        if action == "exit":
            os._exit(5)
        time.sleep(3600)  # a hang: the launch must give up on its own ready timeout

    return hook


@pytest.mark.timeout(60)
@pytest.mark.parametrize("action", ["raise", "exit", "hang"])
def test_die_failing_at_start_up(monkeypatch, action):
    import runtime.pod.die

    monkeypatch.setattr(runtime.pod.die, "pin_die", _startup_hook(action, 1))
    segs, _ = _snapshot()
    cfg = PodConfig(num_dies=3, app_bytes=MiB, timeout_s=5.0, ready_timeout_s=0.5)
    with pytest.raises(Exception) as ei:  # noqa: B017 - the type depends on the failure
        Pod.launch(cfg)  # (a launch that waits for the hung die fails on the test's timeout)
    err = ei.value
    if action == "raise":
        assert isinstance(err, RuntimeError) and err.die_id == 1
        assert "cannot start" in str(err)
    elif action == "exit":
        assert isinstance(err, PodError)
        assert "die 1" in str(err) and "5" in str(err)
    else:
        assert isinstance(err, PodError)
        assert "[1]" in str(err) and "not ready" in str(err)
    assert _snapshot()[0] == segs  # every segment unlinked, the dies are checked by no_leaks


# -- crashes ---------------------------------------------------------------------------------------


@pytest.mark.timeout(60)
def test_sigkill_of_a_die_mid_run_tears_the_pod_down(pod_factory):
    pod = pod_factory(num_dies=4, timeout_s=LONG_S)
    names = pod.segment_names()
    pids = [p.pid for p in pod.procs]
    t0 = time.monotonic()
    with pytest.raises(Exception):  # noqa: B017 - the type is checked by the next test
        pod.run(kill_self_while_peer_waits)
    elapsed = time.monotonic() - t0  # noticed, not die 0's deadline
    assert elapsed < LONG_S / 2, f"pod.run took {elapsed:.1f} s to notice the dead die"
    assert pod.closed
    assert not any((SHM / n.lstrip("/")).exists() for n in names)
    assert all(_zombie_or_gone(pid) for pid in pids)


@pytest.mark.timeout(60)
def test_sigkill_of_a_die_mid_run_is_die_crashed(pod_factory):
    pod = pod_factory(num_dies=4, timeout_s=LONG_S)
    names = pod.segment_names()
    pids = [p.pid for p in pod.procs]
    t0 = time.monotonic()
    with pytest.raises(DieCrashed) as ei:
        pod.run(kill_self_while_peer_waits)
    elapsed = time.monotonic() - t0
    msg = str(ei.value)
    assert "die 1" in msg and "SIGKILL" in msg
    assert elapsed < LONG_S / 2, f"pod.run took {elapsed:.1f} s to notice the dead die"
    assert pod.closed
    assert not any((SHM / n.lstrip("/")).exists() for n in names)
    assert all(_zombie_or_gone(pid) for pid in pids)


@pytest.mark.timeout(60)
def test_die_exiting_mid_run_is_die_crashed(pod_factory):
    pod = pod_factory(num_dies=3)
    with pytest.raises(DieCrashed, match=r"die 2 .*exit code 3"):
        pod.run(exit_hard)
    assert pod.closed


@pytest.mark.timeout(60)
def test_segments_are_owner_only(pod):
    for name in pod.segment_names():
        st = os.stat(SHM / name.lstrip("/"))
        assert stat.S_IMODE(st.st_mode) == 0o600, name
        assert st.st_uid == os.getuid()


@pytest.mark.timeout(90)
def test_spawn_start_method(pod_factory):
    pod = pod_factory(num_dies=2, start_method="spawn")
    assert [r[0] for r in pod.run(whoami, "s")] == [0, 1]
    assert pod.run(exchange_one, 3)[1] == (np.arange(8) + 3).tolist()


# -- the launcher as a separate process: signals and clean-up ----------------------------------

LAUNCHER = textwrap.dedent(
    """
    import json, os, sys, time
    sys.path.insert(0, ROOT)
    from runtime import Pod, PodConfig

    def sleeper(die, seconds):
        os.write(1, f"running {die.die_id}\\n".encode())  # one write: dies share the pipe
        time.sleep(seconds)

    if __name__ == "__main__":
        phase = sys.argv[1]
        with Pod.launch(PodConfig(num_dies=2, app_bytes=1 << 20, timeout_s=30.0)) as pod:
            info = dict(segments=pod.segment_names(), pids=[p.pid for p in pod.procs],
                        pod_id=pod.pod_id)
            print(json.dumps(info), flush=True)
            if phase == "run":
                pod.run(sleeper, 60)
            else:
                print("running idle", flush=True)
                time.sleep(60)
    """
)


class Launcher:
    """A pod launcher in a child Python process; reads what it prints."""

    def __init__(self, tmp_path: Path, phase: str):
        script = tmp_path / "launcher.py"
        script.write_text(LAUNCHER.replace("ROOT)", f"{str(ROOT)!r})", 1))
        self.proc = subprocess.Popen(
            [sys.executable, str(script), phase],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            cwd=str(ROOT),
        )
        try:
            self.info = json.loads(self._line())
            self.segments = [n.lstrip("/") for n in self.info["segments"]]
            self.die_pids = self.info["pids"]
            self.die_ticks = {pid: control.process_start_ticks(pid) for pid in self.die_pids}
            wanted = 2 if phase == "run" else 1
            for _ in range(wanted):
                line = self._line()
                assert line.startswith("running"), f"unexpected launcher output {line!r}"
        except BaseException:
            self.proc.kill()
            self.proc.communicate(timeout=10)
            raise
        time.sleep(0.2)  # the dies are inside `sleeper` (or the launcher sleeps)

    def _line(self) -> str:
        line = self.proc.stdout.readline()
        if not line:
            self.proc.kill()
            _, err = self.proc.communicate(timeout=10)
            raise AssertionError(f"launcher died early: {err}")
        return line

    def signal(self, sig: int, timeout_s: float = 30.0) -> int:
        self.proc.send_signal(sig)
        try:
            self.proc.wait(timeout_s)
        finally:
            if self.proc.poll() is None:
                self.proc.kill()
                self.proc.wait(10)
            self.proc.stdout.close()
            self.stderr = self.proc.stderr.read()
            self.proc.stderr.close()
        return self.proc.returncode

    def dies_gone(self, timeout_s: float = 30.0) -> bool:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            alive = [
                p
                for p in self.die_pids
                if control.process_start_ticks(p) == self.die_ticks[p] and not _zombie_or_gone(p)
            ]
            if not alive:
                return True
            time.sleep(0.05)
        return False

    def segments_left(self) -> list[str]:
        return [n for n in self.segments if (SHM / n).exists()]


@pytest.mark.timeout(60)
@pytest.mark.parametrize("phase", ["run", "idle"])
@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "SIGINT"])
def test_signal_to_launcher_tears_the_pod_down(tmp_path, sig, phase):
    lau = Launcher(tmp_path, phase)
    assert sorted(lau.segments_left()) == sorted(lau.segments)
    code = lau.signal(sig)  # (a launcher that does not exit fails in signal())
    assert code != 0, "the launcher should report the signal"
    assert lau.dies_gone(), "die processes outlived their launcher"
    assert lau.segments_left() == [], f"segments left: {lau.segments_left()}\n{lau.stderr}"


def wait_until(cond, timeout_s: float = 5.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while not cond():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.02)
    return True


@pytest.mark.timeout(60)
@pytest.mark.parametrize("phase", ["run", "idle"])
def test_killed_launcher_its_dies_remove_every_segment(tmp_path, pod_factory, phase):
    live = pod_factory(num_dies=2)
    live_names = [n.lstrip("/") for n in live.segment_names()]
    lau = Launcher(tmp_path, phase)
    lau.signal(signal.SIGKILL)
    assert lau.dies_gone(), "dies must exit with their launcher (PR_SET_PDEATHSIG)"
    assert wait_until(lambda: lau.segments_left() == [], 30.0), lau.segments_left()
    assert lau.info["pod_id"] not in control.list_pods()
    # the live pod of this process is untouched and still works
    assert all((SHM / n).exists() for n in live_names)
    assert len(live.run(whoami, 0)) == 2


class StoppedDieLauncher(Launcher):
    """A launcher SIGKILLed while its die 1 is stopped: die 0 removes its own region; die 1's
    region and the control segment stay until `xpod clean` (die 1 cannot clean up)."""

    def __init__(self, tmp_path):
        super().__init__(tmp_path, "run")
        os.kill(self.die_pids[1], signal.SIGSTOP)
        self.proc.kill()  # not self.signal(): the stopped die holds the stderr pipe open
        self.proc.wait(10)
        self.proc.stdout.close()
        self.proc.stderr.close()
        assert wait_until(lambda: _zombie_or_gone(self.die_pids[0])), "die 0 outlived it"
        self.kept = sorted(n for n in self.segments if not n.endswith(".d0"))
        assert wait_until(lambda: sorted(self.segments_left()) == self.kept), self.segments_left()

    def finish(self) -> None:
        os.kill(self.die_pids[1], signal.SIGKILL)  # stopped: only SIGKILL ends it
        assert wait_until(lambda: _zombie_or_gone(self.die_pids[1]))


@pytest.mark.timeout(60)
@pytest.mark.parametrize("cleaner", ["api", "cli"])
def test_segments_a_killed_launcher_left_are_removed_by_clean(tmp_path, pod_factory, cleaner):
    live = pod_factory(num_dies=2)
    live_names = [n.lstrip("/") for n in live.segment_names()]
    lau = StoppedDieLauncher(tmp_path)
    try:
        assert lau.info["pod_id"] in control.list_pods()
        if cleaner == "api":
            removed = control.clean()
            assert set(lau.kept) <= set(removed)
        else:
            out = subprocess.run(
                [sys.executable, "-m", "runtime.cli", "clean"],
                cwd=str(ROOT),
                env={**os.environ, "PYTHONPATH": str(ROOT)},
                capture_output=True,
                text=True,
                timeout=30,
            )
            assert out.returncode == 0, out.stderr
        assert lau.segments_left() == []
    finally:
        lau.finish()
    # the live pod of this process is untouched and still works
    assert all((SHM / n).exists() for n in live_names)
    assert not set(live_names) & set(control.clean())
    assert len(live.run(whoami, 0)) == 2


TWO_PODS = textwrap.dedent(
    """
    import json, os, sys, time
    sys.path.insert(0, ROOT)
    from runtime import Pod, PodConfig

    cfg = PodConfig(num_dies=1, app_bytes=1 << 20, timeout_s=30.0)
    a = Pod.launch(cfg)
    with Pod.launch(cfg) as b:
        a.close()  # b is still running: a SIGTERM must still tear it down
        print(json.dumps(b.segment_names()), flush=True)
        time.sleep(60)
    """
)


@pytest.mark.timeout(60)
def test_sigterm_tears_down_a_pod_after_another_pod_closed(tmp_path):
    script = tmp_path / "two_pods.py"
    script.write_text(TWO_PODS.replace("ROOT)", f"{str(ROOT)!r})", 1))
    proc = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, text=True)
    try:
        names = [n.lstrip("/") for n in json.loads(proc.stdout.readline())]
        proc.send_signal(signal.SIGTERM)
        proc.wait(15)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)
        proc.stdout.close()
    left = [n for n in names if (SHM / n).exists()]
    control.clean()  # whatever the verdict, leave nothing behind
    assert left == [], f"segments of the running pod left after SIGTERM: {left}"


@pytest.mark.timeout(60)
def test_clean_dry_run_removes_nothing(tmp_path):
    lau = StoppedDieLauncher(tmp_path)
    try:
        listed = control.clean(dry_run=True)
        assert set(lau.kept) <= set(listed)
        assert sorted(lau.segments_left()) == lau.kept
        control.clean()
        assert lau.segments_left() == []
    finally:
        lau.finish()


@pytest.mark.timeout(60)
@pytest.mark.parametrize("timeout_s", ["1", -1, 0, float("nan"), float("inf"), True, [1]])
def test_bad_run_timeout_refused_before_the_dies_run(pod, timeout_s):
    with pytest.raises(ValueError, match="timeout_s"):
        pod.run(whoami, "t", timeout_s=timeout_s)
    assert [r[0] for r in pod.run(whoami, "after")] == list(range(pod.config.num_dies))
