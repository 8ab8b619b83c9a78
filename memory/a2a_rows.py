"""The all-to-all's row geometry: how many rows and how wide each pull / fused area's rows are
(the paper's buffer formula, docs/protocols.md §6-§7), for `memory.layout.compute`."""

from __future__ import annotations

from memory.errors import ConfigError

PULL_ROW_META = 16  # bytes after a dispatch row's payload: scale f32, slot i32, k i32, expert i32
DEDUP_ENTRY = 12  # a dedup dispatch row's list entry: k i32, local expert i32, weight f32


def dedup_entries_off(payload_bytes: int) -> int:
    """Byte offset, in a dedup dispatch row, of its list of (k, local expert, weight) entries:
    right after the payload, 4-byte aligned (docs/protocols.md §6.3)."""
    return -(-payload_bytes // 4) * 4


def a2a_sizes(
    num_dies: int,
    batch: int,
    hidden: int,
    topk: int,
    per_die: int,
    disp_bytes: int = 4,
    comb_bytes: int = 2,
) -> dict:
    """Rows and strides of the pull send areas (docs/protocols.md §6), zeros when batch is 0.

    Dispatch: one half holds every message a die sends in one step, `batch x topk` rows, each a
    float32 payload (INT8 uses the first `hidden` bytes; an INT8-only pod, `disp_bytes` 1, has
    `hidden`-byte payloads) plus PULL_ROW_META. Combine: rows of `comb_bytes x hidden` (bfloat16
    or float32); one half holds every row an expert die returns, at most
    `batch x min(topk, experts_per_die)` from each source die. A dispatch row also has room for
    the list of a dedup row (one row per token and destination die, `dispatch(..., dedup=True)`):
    min(topk, experts_per_die) entries of DEDUP_ENTRY bytes between payload and meta. Strides
    are rounded to 64 bytes (a cache line).
    """
    if not batch:
        return {"disp_rows": 0, "disp_stride": 0, "comb_rows": 0, "comb_stride": 0}
    for name, v in (("a2a_hidden", hidden), ("a2a_topk", topk), ("a2a_experts_per_die", per_die)):
        check_range(name, v, 1, 1 << 20)
    check_range("a2a_max_batch", batch, 1, 1 << 20)
    return {
        "disp_rows": batch * topk,
        "disp_stride": round_up(
            dedup_entries_off(disp_bytes * hidden)
            + DEDUP_ENTRY * min(topk, per_die)
            + PULL_ROW_META,
            64,
        ),
        "comb_rows": num_dies * batch * min(topk, per_die),
        "comb_stride": round_up(comb_bytes * hidden, 64),
    }


def round_up(n: int, align: int) -> int:
    return (n + align - 1) // align * align


def check_range(name: str, value: int, lo: int, hi: int) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or not lo <= value <= hi:
        raise ConfigError(f"{name}: {value!r} is out of range [{lo}, {hi}]")
