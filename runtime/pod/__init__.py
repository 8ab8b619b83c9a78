"""The pod: `PodConfig`, the launcher (`Pod`), the die process (`Die`), the control segment and
what every xpod process does to itself at start (`proc`). Imports `memory` and `comm` only.

The names below are loaded on first use (`memory.lazy`): `runtime.pod.control` (`xpod clean`)
does not need the launcher, the dies or `comm`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from memory.lazy import lazy_exports

if TYPE_CHECKING:  # the same names, for type checkers and the import-direction test
    from runtime.pod.config import PodConfig
    from runtime.pod.die import Die
    from runtime.pod.launcher import DieCrashed, DieHung, Pod

_HOME = {
    "Die": "runtime.pod.die",
    "DieCrashed": "runtime.pod.launcher",
    "DieHung": "runtime.pod.launcher",
    "Pod": "runtime.pod.launcher",
    "PodConfig": "runtime.pod.config",
}
__all__ = ["Die", "DieCrashed", "DieHung", "Pod", "PodConfig"]

__getattr__, __dir__ = lazy_exports(__name__, _HOME)
