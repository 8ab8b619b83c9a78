"""The die progress word (`memory.layout` SV_PROGRESS): one store per phase change, read by the
serving supervisor's hang detector."""

from __future__ import annotations

PROGRESS_STATES = ("compute", "wait", "vote", "park")


def progress_word(step: int, layer: int, phase: int, state: int) -> int:
    """Pack where a die is: its step, layer (-1: outside the layers), the phase it last ended
    (`runtime.model.forward.PHASES` index) and its state (PROGRESS_STATES index)."""
    return (step << 24) | ((layer + 1) & 0xFFF) << 12 | (phase & 0xFF) << 4 | (state & 0xF)


def unpack_progress(word: int) -> tuple[int, int, int, int]:
    """(step, layer, phase, state) of a progress word."""
    w = int(word)
    return w >> 24, ((w >> 12) & 0xFFF) - 1, (w >> 4) & 0xFF, w & 0xF
