"""`Engine._check_launch`: a die or master that exited while the engine starts is an error
now, whatever kind of process the pod has: multiprocessing's `Process` (a one-host pod's dies,
the masters) or a `Popen` (a pod over hosts: `MpiPod.procs` is its mpirun)."""

from __future__ import annotations

import multiprocessing as mp
import subprocess
import sys
import types

import pytest

from runtime.engine.engine import Engine
from runtime.engine.records import EngineError


def bare_engine(procs: list, masters: list) -> Engine:
    eng = object.__new__(Engine)
    eng.pod = types.SimpleNamespace(procs=procs)
    eng.masters = masters
    return eng


@pytest.mark.timeout(30)
def test_a_running_mpirun_popen_passes_and_an_exited_one_is_named():
    p = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    try:
        Engine._check_launch(bare_engine([p], []))  # running: no error (no AttributeError)
    finally:
        p.kill()
        p.wait()
    with pytest.raises(EngineError, match=rf"die 0 \(pid {p.pid}\) exited during the launch"):
        Engine._check_launch(bare_engine([p], []))


@pytest.mark.timeout(30)
def test_an_exited_master_process_is_named_with_its_exit_code():
    q = mp.get_context("spawn").Process(target=sys.exit, args=(3,))
    q.start()
    q.join()
    with pytest.raises(EngineError, match=r"master 0 .* \(exit code 3\)"):
        Engine._check_launch(bare_engine([], [q]))
