"""The pod's control segment `/xpod.<pod_id>.ctl`: manifest, abort word, die pids.

```
 word  0  magic            CTL_MAGIC                 writer: launcher (once)
 word  1  version          CTL_VERSION
 word  2  launcher_pid     pid of the launching process
 word  3  launcher_start   its start time (clock ticks since boot, /proc/<pid>/stat field 22),
                           so `xpod clean` is not fooled by a reused pid
 word  4  num_dies
 word  5  abort_epoch      bumped by the launcher to abort every die's current wait
 word  6  flags            F_HOST_LEADER: made by the host leader of a multi-host pod (its pid
                           is word 2), one control segment per host
 word  8+ die_pid[i]       written by die i at start-up
```
Created first and unlinked last by the launcher, so a region segment without a control segment
always belongs to a dead or dying pod. In a multi-host pod (`runtime.pod.die_mpi`) each host's
leader die plays the launcher's part for its host's segments.
"""

from __future__ import annotations

import mmap
import os
import re
import shutil
from dataclasses import dataclass

import posix_ipc

from memory.errors import ShmError
from memory.region import unlink_segment

CTL_MAGIC = 0x4C54434F44505800  # "\0XPODCTL"
CTL_VERSION = 1
W_MAGIC, W_VERSION, W_PID, W_START, W_NDIES, W_ABORT = 0, 1, 2, 3, 4, 5
W_FLAGS = 6
F_HOST_LEADER = 1
W_DIE_PID = 8
SEGMENT_RE = re.compile(r"^xpod\.([0-9a-f]+)\.(ctl|d\d+|run)$")


def ctl_name(pod_id: str) -> str:
    return f"/xpod.{pod_id}.ctl"


def process_start_ticks(pid: int) -> int:
    """Start time of `pid` in clock ticks since boot, or -1 if there is no such process."""
    try:
        with open(f"/proc/{pid}/stat", encoding="ascii") as f:
            stat = f.read()
    except OSError:
        return -1
    # Field 2 (comm) may contain spaces and parentheses: split after its closing paren.
    rest = stat[stat.rindex(")") + 2 :].split()
    return int(rest[19])


@dataclass
class Control:
    """The mapped control segment."""

    name: str
    words: memoryview
    _mmap: mmap.mmap

    @classmethod
    def create(cls, pod_id: str, num_dies: int, host_leader: bool = False) -> Control:
        """Create the segment (O_CREX, 0600) naming this process as its launcher; a multi-host
        pod's host leader sets `host_leader` (its host's dies then keep the pod live)."""
        name = ctl_name(pod_id)
        size = mmap.PAGESIZE * max(1, -(-(W_DIE_PID + num_dies) * 8 // mmap.PAGESIZE))
        try:
            shm = posix_ipc.SharedMemory(name, flags=posix_ipc.O_CREX, mode=0o600, size=size)
        except (posix_ipc.Error, OSError) as e:
            raise ShmError(f"shm_open({name}, O_CREX): {e}") from e
        try:
            mm = mmap.mmap(shm.fd, size)
        finally:
            shm.close_fd()
        ctl = cls(name, memoryview(mm).cast("q"), mm)
        w = ctl.words
        w[W_VERSION] = CTL_VERSION
        w[W_PID] = os.getpid()
        w[W_START] = process_start_ticks(os.getpid())
        w[W_NDIES] = num_dies
        w[W_FLAGS] = F_HOST_LEADER if host_leader else 0
        w[W_MAGIC] = CTL_MAGIC
        return ctl

    @classmethod
    def attach(cls, pod_id: str) -> Control:
        name = ctl_name(pod_id)
        try:
            shm = posix_ipc.SharedMemory(name)
        except (posix_ipc.Error, OSError) as e:
            raise ShmError(f"shm_open({name}): {e}") from e
        try:
            mm = mmap.mmap(shm.fd, shm.size)
        finally:
            shm.close_fd()
        ctl = cls(name, memoryview(mm).cast("q"), mm)
        if ctl.words[W_MAGIC] != CTL_MAGIC:
            raise ShmError(f"attach({name}): bad magic {ctl.words[W_MAGIC]:#x}")
        return ctl

    def close(self) -> None:
        self.words.release()
        self._mmap.close()

    def unlink(self) -> None:
        unlink_segment(self.name)


def launcher_alive(pid: int, start_ticks: int) -> bool:
    return pid > 0 and process_start_ticks(pid) == start_ticks


def list_pods(shm_dir: str = "/dev/shm") -> dict[str, list[str]]:
    """pod id -> segment names (as in /dev/shm, without the leading slash)."""
    pods: dict[str, list[str]] = {}
    try:
        entries = os.listdir(shm_dir)
    except OSError:
        return pods
    for entry in entries:
        m = SEGMENT_RE.match(entry)
        if m:
            pods.setdefault(m.group(1), []).append(entry)
    return pods


def clean(shm_dir: str = "/dev/shm", dry_run: bool = False, pod_id: str | None = None) -> list[str]:
    """Unlink the segments of every pod whose launcher is gone (only pod `pod_id`'s, if given);
    return the names removed.

    A pod is live while its control segment names a running launcher (pid and start time); a
    host leader's control segment (multi-host pods) also while any die it lists still runs. A pod
    with region segments but no control segment is a pod whose launcher died mid-teardown.
    """
    removed = []
    for pod, names in sorted(list_pods(shm_dir).items()):
        if pod_id is not None and pod != pod_id:
            continue
        if f"xpod.{pod}.ctl" in names:
            try:
                ctl = Control.attach(pod)
            except ShmError:
                alive = False
            else:
                alive = _ctl_live(ctl)
                ctl.close()
            if alive:
                continue
        # Regions and the run directory first, control segment last (as a normal teardown).
        for name in sorted(names, key=lambda n: n.endswith(".ctl")):
            if dry_run or _remove(shm_dir, name):
                removed.append(name)
    return removed


def _ctl_live(ctl: Control) -> bool:
    w = ctl.words
    if launcher_alive(w[W_PID], w[W_START]):
        return True
    if not w[W_FLAGS] & F_HOST_LEADER:
        return False
    n = min(w[W_NDIES], len(w) - W_DIE_PID)
    return any(pid_runs(w[W_DIE_PID + r]) for r in range(max(0, n)))


def pid_runs(pid: int) -> bool:
    """`pid` exists and is not a zombie (a die pid, whose start time is not recorded)."""
    if pid <= 0:
        return False
    try:
        with open(f"/proc/{pid}/stat", encoding="ascii") as f:
            return f.read().rsplit(")", 1)[1].split()[0] not in ("Z", "X")
    except (OSError, IndexError):
        return False


def remove_pod(pod_id: str, shm_dir: str = "/dev/shm") -> list[str]:
    """Unlink every segment of pod `pod_id` on this host, live or not (its launcher knows every
    die is gone); regions first, the control segment last. Returns the names removed."""
    names = sorted(list_pods(shm_dir).get(pod_id, []), key=lambda n: n.endswith(".ctl"))
    return [name for name in names if _remove(shm_dir, name)]


def run_dir_name(pod_id: str) -> str:
    """The pod's run directory (doorbells, zmq sockets of a serving pod), beside its segments."""
    return f"xpod.{pod_id}.run"


def _remove(shm_dir: str, name: str) -> bool:
    if name.endswith(".run"):
        path = os.path.join(shm_dir, name)
        shutil.rmtree(path, ignore_errors=True)
        return not os.path.exists(path)
    return unlink_segment("/" + name)
