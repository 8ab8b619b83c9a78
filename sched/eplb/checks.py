"""Argument checks of the EPLB functions: a bad argument is a TypeError / ValueError naming it
(upstream asserts)."""

from __future__ import annotations

import numpy as np


def check_int(value, name: str, minimum: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int | np.integer):
        raise TypeError(f"{name}: expected an int, got {type(value).__name__} {value!r}")
    if value < minimum:
        raise ValueError(f"{name}: must be >= {minimum}, got {value}")
    return int(value)


def check_weight(weight, name: str = "weight") -> np.ndarray:
    """`weight` as a float64 `[L, E]` copy; loads must be finite and >= 0."""
    arr = np.asarray(weight)
    if arr.dtype.kind not in "iuf":
        raise TypeError(f"{name}: expected an int or float array, got dtype {arr.dtype}")
    if arr.ndim != 2 or arr.shape[0] < 1 or arr.shape[1] < 1:
        raise ValueError(
            f"{name}: expected a non-empty 2-D array [layers, experts], got shape {arr.shape}"
        )
    arr = arr.astype(np.float64)
    bad = ~np.isfinite(arr) | (arr < 0)
    if bad.any():
        where = tuple(int(v) for v in np.argwhere(bad)[0])
        raise ValueError(f"{name}{list(where)} = {arr[where]}: loads must be finite and >= 0")
    return arr


def check_i64(values, name: str, ndim: int) -> np.ndarray:
    arr = np.asarray(values)
    if arr.dtype.kind not in "iu" and not (arr.size == 0 and arr.dtype.kind == "f"):
        raise TypeError(f"{name}: expected an integer array, got dtype {arr.dtype}")
    if arr.ndim != ndim:
        raise ValueError(f"{name}: expected a {ndim}-D array, got shape {arr.shape}")
    return arr.astype(np.int64)


def frozen_i64(arr: np.ndarray) -> np.ndarray:
    arr = np.array(arr, dtype=np.int64, copy=True)
    arr.flags.writeable = False
    return arr
