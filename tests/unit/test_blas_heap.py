"""Process-level tuning every die applies at start (runtime.pod.proc, memory.heap)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

PROBE = """
import sys
sys.path.insert(0, {root!r})
from runtime.pod.proc import blas_threads, limit_blas_threads
from memory.heap import keep_freed_memory
before = blas_threads()
ok = limit_blas_threads(1)
print(before, ok, blas_threads(), keep_freed_memory(), keep_freed_memory())
"""


def test_limit_blas_threads_and_keep_freed_memory_in_a_fresh_process():
    out = subprocess.run(
        [sys.executable, "-c", PROBE.format(root=str(ROOT))],
        capture_output=True, text=True, timeout=60, check=True,
    ).stdout.split()  # fmt: skip
    before, ok, after, heap1, heap2 = out
    if before == "None":  # numpy linked against a BLAS that is not OpenBLAS: nothing to limit
        assert ok == "False" and after == "None"
    else:
        assert ok == "True" and after == "1", out
    assert heap1 == heap2 == "True"
