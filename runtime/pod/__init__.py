"""The pod: `PodConfig`, the launcher (`Pod`), the die process (`Die`), the control segment and
what every xpod process does to itself at start (`proc`). Imports `memory` and `comm` only."""

from runtime.pod.config import PodConfig
from runtime.pod.die import Die
from runtime.pod.launcher import DieCrashed, DieHung, Pod

__all__ = ["Die", "DieCrashed", "DieHung", "Pod", "PodConfig"]
