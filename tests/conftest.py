"""Shared fixtures: leak checks for multi-process tests and a pod factory with tiny sizes.

`no_leaks` is autouse for every test under tests/integration/: after the test it fails the test if
an `xpod.*` segment created during it is left in /dev/shm, or if a child process of the test
process is still there; it cleans up what leaked first (unlink, SIGKILL and reap), so one broken
test does not poison the ones after it.

Other sessions may run pods on the same machine at the same time, so a new segment only counts as
ours if its pod's control segment names this process as launcher, or names a launcher that is no
longer running (a crashed launcher we started), or if the pod has no control segment at all.
"""

from __future__ import annotations

import contextlib
import multiprocessing as mp
import os
import shutil
import signal
import struct
import sys
import time
from pathlib import Path

import posix_ipc
import pytest

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from runtime import Pod, PodConfig  # noqa: E402

# A shell starts a background job (`make test &`, nohup, some CI runners) with SIGINT ignored,
# and exec keeps an ignored signal ignored: the tests' launchers and servers would then ignore
# the Ctrl-C the signal tests send. A handled signal is reset to the default at exec instead.
if signal.getsignal(signal.SIGINT) == signal.SIG_IGN:
    signal.signal(signal.SIGINT, signal.default_int_handler)

SHM_DIR = "/dev/shm"
KiB, MiB = 1 << 10, 1 << 20

# Small pods: a few MiB per die, short deadlines, so a hung test fails fast.
SMALL = dict(num_dies=4, app_bytes=4 * MiB, timeout_s=10.0, ring_slots=8, slot_bytes=16 * KiB)


# -- leak detection --------------------------------------------------------------------------------


def xpod_segments() -> set[str]:
    """Names (no leading '/') of every xpod segment in /dev/shm."""
    try:
        return {e for e in os.listdir(SHM_DIR) if e.startswith("xpod.")}
    except OSError:
        return set()


def _proc_start_ticks(pid: int) -> int:
    try:
        with open(f"/proc/{pid}/stat", encoding="ascii") as f:
            stat = f.read()
    except OSError:
        return -1
    return int(stat[stat.rindex(")") + 2 :].split()[19])


def _proc_stat(pid: int) -> tuple[str, int] | None:
    """(state, ppid) of `pid`, or None if it is gone."""
    try:
        with open(f"/proc/{pid}/stat", encoding="ascii") as f:
            stat = f.read()
    except OSError:
        return None
    rest = stat[stat.rindex(")") + 2 :].split()
    return rest[0], int(rest[1])


def _cmdline(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return ""


def pid_alive(pid: int, start_ticks: int | None = None) -> bool:
    """True if `pid` runs and is not a zombie (and, if given, started at `start_ticks`)."""
    st = _proc_stat(pid)
    if st is None or st[0] in ("Z", "X"):
        return False
    return start_ticks is None or _proc_start_ticks(pid) == start_ticks


def child_pids() -> set[int]:
    """Every child process of this process (zombies included), except multiprocessing helpers."""
    mp.active_children()  # reaps finished multiprocessing children as a side effect
    me = os.getpid()
    pids = set()
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        st = _proc_stat(int(entry))
        if st is not None and st[1] == me:
            pids.add(int(entry))
    for p in mp.active_children():
        pids.add(p.pid)
    # The resource tracker / forkserver of the spawn start methods live as long as pytest.
    return {p for p in pids if not _is_mp_helper(p)}


def _is_mp_helper(pid: int) -> bool:
    cmd = _cmdline(pid)
    return "resource_tracker" in cmd or "forkserver" in cmd


def _ctl_launcher(pod_id: str) -> tuple[int, int] | None:
    """(launcher pid, its start ticks) from a pod's control segment, or None if unreadable."""
    try:
        with open(f"{SHM_DIR}/xpod.{pod_id}.ctl", "rb") as f:
            head = f.read(48)
    except OSError:
        return None
    if len(head) < 48:
        return None
    magic, _version, pid, start, _n, _abort = struct.unpack("<6q", head)
    if magic == 0:
        return None
    return pid, start


def ours(name: str) -> bool:
    """Does segment `name` belong to this test process (or to a dead launcher)?"""
    parts = name.split(".")
    if len(parts) < 3:
        return True
    launcher = _ctl_launcher(parts[1])
    if launcher is None:
        return True  # no control segment: a pod mid-teardown or an orphan
    pid, start = launcher
    return pid == os.getpid() or not pid_alive(pid, start)


def kill_and_reap(pids: set[int]) -> None:
    for pid in pids:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(pid, signal.SIGKILL)
    for pid in pids:
        with contextlib.suppress(ChildProcessError, OSError):
            os.waitpid(pid, 0)
    mp.active_children()


def unlink_all(names: set[str]) -> None:
    for name in names:
        if os.path.isdir(os.path.join(SHM_DIR, name)):  # a serving pod's run directory
            shutil.rmtree(os.path.join(SHM_DIR, name), ignore_errors=True)
            continue
        with contextlib.suppress(posix_ipc.ExistentialError):
            posix_ipc.unlink_shared_memory("/" + name)


def find_leaks(seg_before: set[str], kids_before: set[int], grace_s: float = 15.0):
    """(leaked segment names, leaked child pids) after a grace for in-flight teardown (it
    returns as soon as nothing is left: a leak is what stays, on a slow machine too)."""
    deadline = time.monotonic() + grace_s
    while True:
        kids = child_pids() - kids_before - _shared_pids()
        segs = {s for s in xpod_segments() - seg_before - _shared_segments() if ours(s)}
        if (not kids and not segs) or time.monotonic() > deadline:
            return segs, kids
        time.sleep(0.05)


# Pods shared by the tests of a module (see `shared_pod_factory`): their segments and dies may
# outlive one test, and may be (re)launched by a test's setup, so the leak check skips them.
_SHARED: list[Pod] = []


def _shared_segments() -> set[str]:
    return {n.lstrip("/") for pod in _SHARED if not pod.closed for n in pod.segment_names()}


def _shared_pids() -> set[int]:
    return {p.pid for pod in _SHARED if not pod.closed for p in pod.procs}


@pytest.fixture
def leak_check():
    """Fail the test if it leaves an xpod segment or a child process behind (and clean them)."""
    seg_before = xpod_segments()
    kids_before = child_pids()
    yield
    segs, kids = find_leaks(seg_before | _shared_segments(), kids_before | _shared_pids())
    desc = {pid: _cmdline(pid)[:120] for pid in kids}
    kill_and_reap(kids)
    # Killing a leaked launcher may leave its pod's segments: count and remove those too.
    segs |= {s for s in xpod_segments() - seg_before - _shared_segments() if ours(s)}
    unlink_all(segs)
    problems = []
    if segs:
        problems.append(f"segments left in {SHM_DIR}: {sorted(segs)}")
    if kids:
        problems.append(f"child processes left running: {desc}")
    if problems:
        pytest.fail("leak: " + "; ".join(problems), pytrace=False)


@pytest.fixture(autouse=True)
def no_leaks(request):
    """Autouse leak check for tests/integration/ (unit tests opt in with `leak_check`)."""
    if "integration" in Path(str(request.node.path)).parts:
        request.getfixturevalue("leak_check")
    yield


# -- pods ------------------------------------------------------------------------------------------


def small_config(**overrides) -> PodConfig:
    return PodConfig(**{**SMALL, **overrides})


class PodFactory:
    """Launches pods with small sizes and closes every one of them at the end."""

    def __init__(self):
        self.pods: list[Pod] = []

    def __call__(self, **overrides) -> Pod:
        pod = Pod.launch(small_config(**overrides))
        self.pods.append(pod)
        return pod

    def close(self) -> None:
        for pod in self.pods:
            pod.close()
        self.pods.clear()


@pytest.fixture
def pod_factory():
    """`pod_factory(num_dies=2, timeout_s=1.0)` -> a running Pod, closed after the test."""
    factory = PodFactory()
    try:
        yield factory
    finally:
        factory.close()


class SharedPod:
    """A pod shared by the tests of one module, relaunched after a test that failed with it.

    `get()` returns the running pod (launching it if needed); `discard()` closes it so that the
    next `get()` starts from a fresh pod: a test that fails mid-transfer may leave a pair of dies
    with mismatched counters, and must not make every later test fail too.
    """

    def __init__(self, **overrides):
        self.config = small_config(**overrides)
        self.pod: Pod | None = None

    def get(self) -> Pod:
        if self.pod is None or self.pod.closed:
            self.discard()
            self.pod = Pod.launch(self.config)
            _SHARED.append(self.pod)
        return self.pod

    def discard(self) -> None:
        if self.pod is not None:
            try:
                self.pod.close()
            finally:
                _SHARED.remove(self.pod)
                self.pod = None


@pytest.fixture(scope="module")
def shared_pod_factory():
    """`shared_pod_factory(**overrides)` -> SharedPod, closed at the end of the module."""
    made: list[SharedPod] = []

    def make(**overrides) -> SharedPod:
        sp = SharedPod(**overrides)
        made.append(sp)
        return sp

    try:
        yield make
    finally:
        for sp in made:
            sp.discard()


def release_shared(shared: SharedPod, request) -> None:
    rep = getattr(request.node, "rep_call", None)
    if rep is None or not rep.passed or (shared.pod is not None and shared.pod.closed):
        shared.discard()


@pytest.fixture
def shared_pod_guard(request):
    """Yields a function `(shared) -> pod`; after the test, discards pods if the test failed."""
    used: list[SharedPod] = []

    def take(shared: SharedPod) -> Pod:
        used.append(shared)
        return shared.get()

    yield take
    for shared in used:
        release_shared(shared, request)


@pytest.hookimpl(wrapper=True, tryfirst=True)
def pytest_runtest_makereport(item, call):
    rep = yield
    setattr(item, "rep_" + rep.when, rep)
    return rep
