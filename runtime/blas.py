"""One BLAS thread per die.

numpy's OpenBLAS starts one worker thread per core and its workers spin for a while after each
call. A die is one emulated NPU core-group on a machine whose cores are shared by every die, so
those workers only steal the cores the other dies need: on the 2-core CI machine, 4 dies of the
toy model spent ~7 ms of CPU per decode step for ~3.6 ms of work, and a `swiglu` of 2 rows took
~285 us instead of tens. `limit_blas_threads(1)` is called by every die at start and by the
single-process reference runs, which are defined to use one core.

It finds the OpenBLAS library already mapped into the process (numpy's wheels bundle
`libscipy_openblas64_`, distributions link `libopenblas`) and calls its `*_set_num_threads`; for
any other BLAS it does nothing and says so. Results do not depend on the thread count here
(checked: the reference's logits are byte-identical with 1 and 2 threads).
"""

from __future__ import annotations

import ctypes

_SETTERS = ("scipy_openblas_set_num_threads64_", "openblas_set_num_threads64_",
            "openblas_set_num_threads")  # fmt: skip
_GETTERS = ("scipy_openblas_get_num_threads64_", "openblas_get_num_threads64_",
            "openblas_get_num_threads")  # fmt: skip


def _openblas_libs() -> list[str]:
    import numpy  # noqa: F401 - loads the BLAS numpy links

    try:
        with open("/proc/self/maps") as f:
            paths = {line.split()[-1] for line in f if "openblas" in line.lower()}
    except OSError:
        return []
    return sorted(p for p in paths if p.startswith("/"))


def _call(names: tuple[str, ...], *args: int) -> int | None:
    for path in _openblas_libs():
        lib = ctypes.CDLL(path)
        for name in names:
            fn = getattr(lib, name, None)
            if fn is not None:
                return int(fn(*args) or 0) if args else int(fn())
    return None


def limit_blas_threads(n: int = 1) -> bool:
    """Set OpenBLAS's thread count in this process; False when no OpenBLAS is loaded."""
    return _call(_SETTERS, int(n)) is not None


def blas_threads() -> int | None:
    """OpenBLAS's current thread count, or None when no OpenBLAS is loaded."""
    return _call(_GETTERS)
